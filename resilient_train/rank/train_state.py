"""The train state: what a step boundary must capture to be replayed exactly.

Two parts, because they heal differently:

* *replicated*: the model, the optimizer, and whatever else every
  data-parallel replica holds the same (LR schedulers, a GradScaler). A rank
  that lost it copies it from a live replica.
* *local*: the step (the data position), the RNG states and the user's own
  per-rank state (a data loader's position, say). Each rank publishes its own
  at every step (a few KB, :mod:`resilient_train.rank.local_state`), so a
  replacement takes over the state of the rank it replaces.
"""

from __future__ import annotations

import array
import random
import sys
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from checkpointing.tree import Pair, pairs
from resilient_train.rank.ddp import ReplicatedModule

__all__ = ["RngUse", "Stateful", "TrainState", "as_float", "capture_rng", "restore_rng"]


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RngUse:
    """Whether the script ever drew from ``random`` or NumPy's global RNG.

    A script that never uses them and never seeds them carries a different
    (unused) state in every process; the final state marks such a state
    ``"unused"`` so two fault-free runs still compare equal. The flags travel in
    the local state, so a replacement inherits its predecessor's.
    """

    def __init__(self) -> None:
        self.used = {"python": False, "numpy": False}
        self._last: dict[str, Any] = {}

    def observe(self, name: str, state: Any) -> None:
        if not self.used[name]:
            last = self._last.get(name)
            if last is not None and not _same(last, state):
                self.used[name] = True
            self._last[name] = state

    def reset_to(self, used: Mapping[str, bool], states: Mapping[str, Any]) -> None:
        self.used = {k: bool(used.get(k, False)) for k in self.used}
        self._last = dict(states)


def _same(a: Any, b: Any) -> bool:
    """Two states of one generator (lists of plain values and tensors), by value."""
    return all(isinstance(p, Pair) and _same_leaf(p.a, p.b) for p in pairs(a, b, sequences_alike=True))


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def capture_rng(use: RngUse | None = None) -> dict[str, Any]:
    """The RNG states of torch (CPU and every initialised CUDA device), ``random`` and NumPy."""
    py = _to_plain(random.getstate())
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": py}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        # The 624 uint32 words as int32 (their bits): half the bytes of int64, in every step's local state.
        rng["numpy"] = [name, torch.from_numpy(keys.astype("uint32").view("int32")), pos, has_gauss, cached]
    if use is not None:
        use.observe("python", py)
        if "numpy" in rng:
            use.observe("numpy", rng["numpy"])
        rng["used"] = dict(use.used)
    return rng


def restore_rng(rng: dict[str, Any], use: RngUse | None = None) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(_to_tuple(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np

        name, keys, pos, has_gauss, cached = rng["numpy"]
        words = keys.numpy()
        words = words.view("uint32") if words.dtype == np.int32 else words.astype("uint32")  # int64: older states
        np.random.set_state((name, words, pos, has_gauss, cached))
    if use is not None:
        use.reset_to(rng.get("used", {}), {k: rng[k] for k in ("python", "numpy") if k in rng})


def _to_plain(state: tuple) -> list:
    version, internal, gauss = state
    # A tensor of the 625 uint32 words, as int32 (their bits): 2.5 KB that serialize in one piece (a list
    # pickles word by word; int64 took twice the bytes in every step's local state).
    return [version, torch.frombuffer(array.array("I", internal), dtype=torch.int32).clone(), gauss]


def _to_tuple(state: list) -> tuple:
    version, internal, gauss = state
    if isinstance(internal, torch.Tensor):  # int32: the words' bits; int64: older states
        internal = (internal.view(torch.uint32) if internal.dtype == torch.int32 else internal).tolist()
    return (version, tuple(internal), gauss)


class TrainState:
    """The model, its optimizer, the data position and the RNG states of one rank.

    ``step`` counts completed steps; with data that is a function of
    ``(seed, step, rank)`` it is the whole data position. ``replicated`` holds
    more objects every replica holds the same (``{"scheduler": sched}``);
    ``extra`` is a per-rank object (a data loader). Both need
    ``state_dict``/``load_state_dict``.

    ``model`` may be what ``sup.ddp(model)`` returned: the state is the module
    inside it, with the same keys as ``TrainState(model=model)`` (no ``module.``
    prefix), so checkpoints and heals do not depend on how the model was given.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        replicated: Mapping[str, Stateful] | None = None,
        extra: Stateful | None = None,
        step: int = 0,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, ReplicatedModule):
            model = model.module  # sup.ddp's wrapper: the state is the model's own, keyed as the bare model's
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("pass the module inside DDP (TrainState(model=model)) and wrap it with sup.ddp(model): "
                             "a DDP object is tied to one generation's process group")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for name, obj in (replicated or {}).items():
            if not isinstance(obj, Stateful):
                raise ValueError(f"replicated[{name!r}] must have state_dict() and load_state_dict()")
        if extra is not None and not isinstance(extra, Stateful):
            raise ValueError("extra must have state_dict() and load_state_dict()")
        self.model = model
        self.optimizer = optimizer
        self.replicated = dict(replicated or {})
        self.extra = extra
        self.step = step
        self.rng_use = RngUse()
        # Per-rank state the runtime keeps for itself (the rerun machine): saved and restored beside the user's.
        self.runtime: dict[str, Stateful] = {}

    def replicated_state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            sd["optimizer"] = self.optimizer.state_dict()
        if self.replicated:
            sd["replicated"] = {name: obj.state_dict() for name, obj in self.replicated.items()}
        return sd

    def load_replicated(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        for name, obj in self.replicated.items():
            obj.load_state_dict(sd["replicated"][name])

    def shard_state_dict(self) -> dict[str, Any]:
        """What this rank holds of the replicated and sharded state, as plain tensors (its DTensors' local
        shards, :mod:`resilient_train.rank.shard_state`): what heals and what a buddy keeps. The same as
        :meth:`replicated_state_dict` for a model without DTensors."""
        from resilient_train.rank.shard_state import to_local

        return to_local(self.replicated_state_dict())

    def load_shard_state(self, sd: dict[str, Any]) -> None:
        """Loads what :meth:`shard_state_dict` returned on a rank of the same replica class."""
        from resilient_train.rank.shard_state import has_dtensor, load_local_into, load_optimizer_local

        live = self.model.state_dict()
        if not has_dtensor(live):
            self.load_replicated(sd)
            return
        load_local_into(live, sd["model"], what="model")
        if self.optimizer is not None:
            load_optimizer_local(self.optimizer, sd["optimizer"])
        for name, obj in self.replicated.items():
            obj.load_state_dict(sd["replicated"][name])

    def reseeded(self) -> None:
        """The RNGs were just seeded for a logical rank (sup.seed): that is not a use of them by the script."""
        rng = capture_rng()
        self.rng_use.reset_to(self.rng_use.used, {k: rng[k] for k in ("python", "numpy") if k in rng})

    def local_state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"step": self.step, "rng": capture_rng(self.rng_use)}
        if self.extra is not None:
            sd["extra"] = self.extra.state_dict()
        for name, obj in self.runtime.items():
            sd[name] = obj.state_dict()
        return sd

    def load_local(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        restore_rng(sd["rng"], self.rng_use)
        if self.extra is not None and "extra" in sd:
            self.extra.load_state_dict(sd["extra"])
        for name, obj in self.runtime.items():
            if name in sd:
                obj.load_state_dict(sd[name])

    def state_dict(self, *, local_states: dict[int, dict[str, Any]],
                   replicated: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole job's state: replicated once, each rank's local state by rank.

        ``replicated`` replaces :meth:`replicated_state_dict` (a sharded state, gathered).

        An RNG the script never used is written as ``"unused"``: its value is
        whatever the process started with, not part of the run.
        """
        ranks = {}
        for r, s in sorted(local_states.items()):
            s = dict(s)
            rng = dict(s.get("rng", {}))
            used = rng.pop("used", None)
            if used is not None:
                for name in ("python", "numpy"):
                    if name in rng and not used.get(name, True):
                        rng[name] = "unused"
            s["rng"] = rng
            ranks[str(r)] = s
        return {**(self.replicated_state_dict() if replicated is None else replicated), "ranks": ranks}


def as_float(x: Any) -> float | None:
    """A step's output as a plain number for logs and validators (None if it is not one)."""
    if isinstance(x, torch.Tensor):
        return float(x.detach().float().item())
    if isinstance(x, (int, float)):
        return float(x)
    return None
