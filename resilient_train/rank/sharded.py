"""A module parallelised on a device mesh (FSDP2, tensor parallel, HSDP), built again every generation.

``fully_shard`` and ``parallelize_module`` tie a module to a mesh, and a mesh
to its process groups: after a fault those are finished. ``sup.sharded(model,
parallelize, mesh=MeshSpec(...))`` returns a :class:`ShardedModule`; call it as
you would the parallelised model. Every generation it makes a fresh copy of the
model's structure (on the meta device, no memory), applies ``parallelize(copy,
mesh)`` on the new mesh, allocates it, and fills it with what this rank held:

* the first time in a process, the local shards of the model's own values
  (``distribute_tensor(..., src_data_rank=None)``: each rank cuts its own piece,
  no communication; the same pieces ``fully_shard`` cuts in a plain loop);
* afterwards, the previous generation's local shards (the world size is kept,
  so the layout is the same).

The optimizer's parameters are swapped for the new ones and its state re-wrapped
on the new mesh, so the optimizer (and an LR scheduler holding it) stays the
same object. After the first build, the model passed in is a template on the
meta device: calling it is a misuse, said in one line.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from resilient_train.rank.errors import UsageError
from resilient_train.rank.phased import forward_in_phases

__all__ = ["Parallelize", "ShardedModule", "check_sharded_run", "remap_optimizer"]

Parallelize = Callable[[torch.nn.Module, DeviceMesh], Any]


class ShardedModule(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, parallelize: Parallelize,
                 phase: Callable[[str], None] = lambda name: None) -> None:
        super().__init__()
        if not callable(parallelize):
            raise UsageError("sup.sharded(model, parallelize): parallelize must be a function (module, mesh)")
        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise UsageError("sup.sharded(model, ...): pass the model before fully_shard/parallelize_module: "
                             "the supervisor applies parallelize on every generation's mesh")
        object.__setattr__(self, "_template", module)  # not a submodule: state_dict() is the current module's
        object.__setattr__(self, "_current", None)
        self._parallelize = parallelize
        self._phase = phase
        self._skeleton = _meta_copy(module)
        self._previous: dict[str, torch.Tensor] | None = None  # local tensors of the last generation
        self._old_params: dict[str, torch.nn.Parameter] = dict(module.named_parameters())

    @property
    def module(self) -> torch.nn.Module:
        """The current generation's parallelised module (use it for DCP's state_dict APIs)."""
        if self._current is None:
            raise UsageError("the sharded model exists once a generation's mesh is built (inside sup.run)")
        return self._current

    def rebuild(self, mesh: DeviceMesh, device: torch.device, optimizer: torch.optim.Optimizer | None) -> None:
        """Parallelises a fresh copy on ``mesh`` and moves this rank's state into it."""
        self.drop()
        fresh = copy.deepcopy(self._skeleton)
        self._parallelize(fresh, mesh)
        fresh.to_empty(device=device)
        with torch.no_grad():
            if self._previous is None:
                values = {**dict(self._template.named_parameters()), **dict(self._template.named_buffers())}
                for name, t in _named_tensors(fresh):
                    src = values[name].detach().to(device)
                    if isinstance(t, DTensor):
                        t.to_local().copy_(distribute_tensor(src, t.device_mesh, t.placements,
                                                             src_data_rank=None).to_local())
                    else:
                        t.copy_(src)
                self._retire_template()
            else:
                for name, t in _named_tensors(fresh):
                    (t.to_local() if isinstance(t, DTensor) else t).copy_(self._previous[name])
        new_params = dict(fresh.named_parameters())
        if optimizer is not None:
            remap_optimizer(optimizer, {id(self._old_params[n]): p for n, p in new_params.items()})
        self._old_params = new_params
        self._previous = None
        object.__setattr__(self, "_current", fresh)

    def drop(self) -> None:
        """Forgets this generation's module (it holds the generation's groups), keeping its local tensors."""
        if self._current is not None:
            # The parameters FSDP registered when it was built are the sharded ones; a fault mid-step may
            # leave the unsharded ones registered in their place (named_parameters() would give those).
            tensors = [*self._old_params.items(), *self._current.named_buffers()]
            self._previous = {n: (t.to_local() if isinstance(t, DTensor) else t).detach() for n, t in tensors}
        object.__setattr__(self, "_current", None)

    def _retire_template(self) -> None:
        """The model passed in is a template from now on: its memory goes, and calling it says so."""
        template = self._template
        template.to("meta")

        def refuse(module: torch.nn.Module, args: Any) -> None:
            raise UsageError("the model given to sup.sharded was called: call the module sup.sharded returned "
                             "(it is built again on every generation's mesh)")

        template.register_forward_pre_hook(refuse)

    # ---------------------------------------------------------- nn.Module
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return forward_in_phases(self.module, self._phase, *args, **kwargs)

    def _target(self) -> torch.nn.Module:
        return self._current if self._current is not None else self._template

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.module.load_state_dict(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:  # type: ignore[override]
        return self._target().named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:  # type: ignore[override]
        return self._target().parameters(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        return self._target().named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:  # type: ignore[override]
        return self._target().buffers(recurse)

    def train(self, mode: bool = True) -> "ShardedModule":
        super().train(mode)
        self._target().train(mode)
        return self


def remap_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, torch.nn.Parameter]) -> None:
    """Points ``optimizer`` at new parameters (``id(old) -> new``); its state moves to the new layout.

    A DTensor state is re-wrapped on the new parameter's mesh (same local tensor);
    a plain one shaped like an unsharded parameter (an optimizer built on the
    model before it was sharded) is cut into the new parameter's local shard.
    """
    old_state = optimizer.state
    new_state: dict[torch.nn.Parameter, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        params = []
        for old in group["params"]:
            new = mapping.get(id(old))
            if new is None:
                raise UsageError("the optimizer holds a parameter that is not the sharded model's: build it on "
                                 "the model's parameters (or on sup.sharded's)")
            params.append(new)
            if old in old_state:
                new_state[new] = {k: _moved(v, new) for k, v in old_state[old].items()}
        group["params"] = params
    optimizer.state = defaultdict(dict, new_state)


def _moved(value: Any, param: torch.nn.Parameter) -> Any:
    if not isinstance(value, torch.Tensor) or not isinstance(param, DTensor):
        return value
    if isinstance(value, DTensor):
        return DTensor.from_local(value.to_local(), param.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    if value.shape == param.shape and value.dim() > 0:
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s structure with every tensor on the meta device (nothing is copied)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)



def check_sharded_run(module: ShardedModule, model: Any, *, snapshot_every: int | None, rerun: bool) -> None:
    """A run of ``module`` (sup.sharded's): ``model`` (the TrainState's) must be it, with no host snapshots
    and no rerun machine."""
    from resilient_train.rank.errors import UsageError

    if model is not module:
        raise UsageError("TrainState(model=...) must be the module sup.sharded returned")
    if snapshot_every is not None:
        raise UsageError("snapshot_every with sup.sharded: sharded state is covered by replicas and buddy "
                         "copies (SupervisorConfig.buddy_every)")
    if rerun:
        raise UsageError("the rerun machine does not support sup.sharded yet")
