"""Megatron's ``parallel_state``, torn down and rebuilt on every generation's process group.

Megatron keeps its groups in module globals and its modules copy them at
construction (``self.tp_group``, ``self.pg_collection``), so a restart that
only calls ``destroy_model_parallel`` and ``initialize_model_parallel`` again
leaves groups behind in three places: torch's group map (everything but the
gloo groups stays registered), Megatron's own globals (rank lists, a few
groups), and every module built before. :class:`MegatronParallel` clears all
three on :meth:`teardown` and points the tracked modules at the new
generation's groups on :meth:`build`, by role (``tp``, ``pp``, ``dp``, ...).

Build the model before the first generation with :attr:`MegatronParallel.groups`
as its ``pg_collection``: until a generation exists its groups are
:class:`~.groups.LayoutGroup` placeholders that know their rank and size from
the layout, which is all construction reads. The same collection object is
updated in place each generation.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from checkpointing.tree import children
from resilient_train.rank.errors import UsageError
from resilient_train.rank.group import abort_nccl
from resilient_train.integrations.megatron.groups import (
    GroupCount, GroupCensus, LayoutGroup, group_values, is_group, reset_module_state, snapshot_module_state,
)
from resilient_train.integrations.megatron.layout import ParallelLayout

__all__ = ["MegatronConfig", "MegatronParallel", "require_megatron"]

# A Megatron module built while no process group exists keeps None for its group
# (``get_tensor_model_parallel_group_if_none`` returns None before ``init_process_group``):
# such an attribute's role is its name.
_ROLE_OF_ATTR = {
    "tp_group": "tp", "attn_tp_group": "tp", "cp_group": "cp", "ep_group": "ep", "dp_group": "dp",
    "pp_group": "pp", "embd_group": "embd", "tp_cp_group": "tp_cp", "tp_ep_group": "tp_ep",
    "tp_dp_cp_group": "tp_dp_cp",
}

# Which coordinates vary inside each group of Megatron's ProcessGroupCollection (dense layout, no experts).
_VARYING = {
    "tp": "tp", "pp": "pp", "mp": "tp-pp", "cp": "cp", "tp_cp": "tp-cp", "dp": "dp", "dp_cp": "dp-cp",
    "tp_dp_cp": "tp-dp-cp", "expt_tp": "tp", "tp_ep": "tp", "tp_ep_pp": "tp-pp", "expt_dp": "dp-cp",
}


def require_megatron() -> Any:
    """Imports ``megatron.core``, or says how to get it."""
    try:
        return importlib.import_module("megatron.core.parallel_state")
    except ImportError as e:
        raise UsageError(f"the Megatron-Core integration needs megatron-core (pip install "
                         f"'resilient-train[megatron]'): {e}") from None


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """What ``initialize_model_parallel`` is given each generation."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    order: str = "tp-cp-ep-dp-pp"
    # Megatron's default is True (its distributed optimizer checkpoints through gloo); every gloo group is
    # one more set of sockets per generation, so the integration builds them only when asked.
    gloo_groups: bool = False
    timeout_minutes: float = 0.5  # bounds every collective on Megatron's groups (the supervisor's default, 30 s)

    def __post_init__(self) -> None:
        if not self.timeout_minutes > 0:
            raise ValueError(f"MegatronConfig.timeout_minutes must be > 0, got {self.timeout_minutes!r}")

    def layout(self, world_size: int) -> ParallelLayout:
        return ParallelLayout(world_size=world_size, tensor=self.tensor, pipeline=self.pipeline,
                              context=self.context, order=self.order)


class MegatronParallel:
    """One rank's Megatron parallel state across generations (see the module docstring)."""

    def __init__(self, config: MegatronConfig, *, rank: int, world_size: int) -> None:
        self.config = config
        self.layout = config.layout(world_size)
        self.rank = rank
        self._ps = require_megatron()
        if self._ps.model_parallel_is_initialized():
            raise UsageError("megatron's parallel state is already initialized: let the integration build it "
                             "on each generation's process group (do not call initialize_model_parallel)")
        self._pristine = snapshot_module_state(self._ps)
        from megatron.core.process_groups_config import ProcessGroupCollection

        self._pgc_type = ProcessGroupCollection
        self._placeholders = self._layout_groups()
        self.groups = ProcessGroupCollection()  # the one collection the model is given, updated in place
        self._set_fields(self.groups, self._placeholders)
        self._modules: list[torch.nn.Module] = []
        self._current: dict[str, Any] | None = None  # role -> this generation's group
        self.census = GroupCensus()
        self.generation: int | None = None
        self.stale: list[str] = []  # Megatron globals destroy_model_parallel left behind at the last teardown
        self.repointed = 0  # module attributes pointed at the new groups at the last build

    # ------------------------------------------------------------- public
    def track(self, *modules: torch.nn.Module) -> None:
        """Modules whose process-group attributes follow the generations (the model, its wrappers)."""
        for m in modules:
            if not isinstance(m, torch.nn.Module):
                raise ValueError(f"track() takes torch.nn.Module objects, got {type(m).__name__}")
            self._modules.append(m)
        if self._current is not None:
            self.repointed = self._repoint(self._current)

    def build(self, generation: int) -> None:
        """Megatron's groups on this generation's default group; the tracked modules use them."""
        if not dist.is_initialized():
            raise UsageError("MegatronParallel.build needs the generation's process group")
        if self._current is not None:
            self.teardown()
        if dist.get_world_size() != self.layout.world_size:
            raise UsageError(f"the world has {dist.get_world_size()} ranks, the layout {self.layout.world_size}")
        before = set(c10d._world.pg_map)
        self._ps.initialize_model_parallel(
            tensor_model_parallel_size=self.config.tensor, pipeline_model_parallel_size=self.config.pipeline,
            context_parallel_size=self.config.context, order=self.config.order,
            create_gloo_process_groups=self.config.gloo_groups,
            distributed_timeout_minutes=self.config.timeout_minutes,
        )
        self.census.track([g for g in c10d._world.pg_map if g not in before])
        built = self._pgc_type.use_mpu_process_groups()
        self._current = {f.name: getattr(built, f.name, None) for f in fields(self._pgc_type)}
        self._set_fields(self.groups, self._current)
        self.repointed = self._repoint(self._current)
        self.generation = generation

    def teardown(self, *, abort: bool = False) -> GroupCount:
        """Drops every reference to this generation's Megatron groups and destroys them; returns the count.

        Safe to call with nothing built. Call it before the default group is
        destroyed (the supervisor does, through the part). ``abort``: abort the
        NCCL communicators first (a peer may be dead: a plain destroy could
        wait for work that never completes).
        """
        if self._current is not None:
            self._repoint(self._placeholders)
            self._set_fields(self.groups, self._placeholders)
            mine = [g for g in c10d._world.pg_map if g is not dist.GroupMember.WORLD]
            self._current = None
            if abort:
                abort_nccl()
            self._ps.destroy_model_parallel()
            _destroy(mine)  # destroy_model_parallel destroys its gloo groups only
            del mine
        self.stale = reset_module_state(self._ps, self._pristine)
        return self.census.count()

    def count(self) -> GroupCount:
        return self.census.count()

    # ------------------------------------------------------------ helpers
    def _layout_groups(self) -> dict[str, Any]:
        lay, r = self.layout, self.rank
        out: dict[str, Any] = {f.name: None for f in fields(self._pgc_type)}
        for role, kind in _VARYING.items():
            index, size = lay.position(r, kind)
            out[role] = LayoutGroup(role, index, size)
        out["ep"] = LayoutGroup("ep", 0, 1)
        out["intra_dp_cp"] = out["dp_cp"]
        out["intra_expt_dp"] = out["expt_dp"]
        out["intra_dist_opt"] = LayoutGroup("intra_dist_opt", r, lay.world_size)
        c = lay.coords(r)
        last = lay.pipeline - 1
        if c.pp in (0, last):  # the embedding group: the first and the last stage
            out["embd"] = LayoutGroup("embd", 0 if c.pp == 0 else 1, 1 if last == 0 else 2)
        if c.pp == 0:
            out["pos_embd"] = LayoutGroup("pos_embd", 0, 1)
        return out

    def _set_fields(self, pgc: Any, groups: dict[str, Any]) -> None:
        for name, g in groups.items():
            setattr(pgc, name, g)

    def _roles(self) -> dict[int, str]:
        """id of every group object the modules may hold (placeholders or the current groups) -> its role."""
        roles: dict[int, str] = {}
        for table in (self._placeholders, self._current or {}):
            for name, g in table.items():
                for v in group_values(g):
                    roles.setdefault(id(v), name)
        return roles

    def _repoint(self, target: dict[str, Any]) -> int:
        """Every group a tracked module holds, replaced by ``target``'s group of the same role."""
        roles = self._roles()
        moved = 0
        for path, owner, key, value in self._references():
            role = roles.get(id(value)) if value is not None else _role_by_name(owner, key)
            if role is None:
                raise UsageError(f"{path} holds a process group the Megatron integration did not build "
                                 f"({value!r}): it would be left on a dead generation; build it from "
                                 f"MegatronParallel.groups")
            new = target.get(role)
            if new is None:
                new = self._placeholders.get(role)
            _assign(owner, key, new)
            moved += 1
        return moved

    def _references(self) -> Iterator[tuple[str, Any, Any, Any]]:
        """(path, owner, key, group) for each group held by a tracked module (attributes, collections)."""
        seen: set[int] = set()
        for top in self._modules:
            for mname, module in top.named_modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for attr, value in list(vars(module).items()):
                    path = f"{type(top).__name__}.{mname + '.' if mname else ''}{attr}"
                    if isinstance(value, self._pgc_type):
                        if value is self.groups:
                            continue
                        for f in fields(self._pgc_type):
                            v = getattr(value, f.name, None)
                            if is_group(v):
                                yield f"{path}.{f.name}", value, f.name, v
                    elif is_group(value) or (value is None and _role_by_name(module, attr) is not None):
                        yield path, module, attr, value
                    elif isinstance(value, (list, dict)):  # a tuple's slots cannot be given a new group
                        for k, v in children(value) or ():
                            if is_group(v):
                                yield f"{path}[{k!r}]", value, k, v


def _destroy(groups: list[Any]) -> None:
    """Unregisters each group still registered (a helper: no loop variable outlives it)."""
    while groups:
        g = groups.pop()
        if g in c10d._world.pg_map:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001  (a broken group has nothing left to release)
                pass
        del g


def _role_by_name(owner: Any, attr: Any) -> str | None:
    if not isinstance(owner, torch.nn.Module) or not type(owner).__module__.startswith("megatron."):
        return None
    role = _ROLE_OF_ATTR.get(attr)
    if role == "tp" and getattr(owner, "is_expert", False):
        return "expt_tp"
    return role


def _assign(owner: Any, key: Any, value: Any) -> None:
    if isinstance(owner, (list, dict)):
        owner[key] = value
    elif isinstance(owner, torch.nn.Module):
        # Module.__setattr__ would refuse nothing here, but going through __dict__ keeps hooks out of it.
        owner.__dict__[key] = value
    else:
        setattr(owner, key, value)
