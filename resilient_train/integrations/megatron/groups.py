"""Process groups across generations: placeholders before the first one, a census of the ones alive.

* :class:`LayoutGroup` stands in for a process group while none exists (before
  the first generation, between two): it answers ``rank()`` and ``size()``
  from the layout, which is all Megatron's modules read while they are built,
  and fails any other use with a message that names its role.
* :class:`GroupCensus` keeps a weak reference to every group the integration
  built. After a teardown none may be alive: one that is, is held by
  something (a module attribute, a Megatron global, a user's object) and
  keeps its communicator, its sockets and, with NCCL, its memory (what
  Megatron-LM #6897 leaks each restart).
* :func:`reset_module_state` puts Megatron's ``parallel_state`` globals back
  to what they were before the first ``initialize_model_parallel``:
  ``destroy_model_parallel`` leaves the rank lists and some groups behind
  (the stale topology of Megatron-LM #7139).
"""

from __future__ import annotations

import copy
import gc
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from checkpointing.tree import children

__all__ = ["GroupCount", "GroupCensus", "LayoutGroup", "group_values", "is_group", "reset_module_state",
           "snapshot_module_state"]


class LayoutGroup:
    """A process group's rank and size, without the group (see the module docstring)."""

    def __init__(self, role: str, rank: int, size: int) -> None:
        self.role, self._rank, self._size = role, rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the {self.role!r} process group does not exist yet (or any more): only rank() and "
                           f"size() are known outside a generation, not {name!r}; a communicator is used only "
                           f"inside the supervisor's run")

    def __repr__(self) -> str:
        return f"LayoutGroup({self.role!r}, rank={self._rank}, size={self._size})"


def is_group(value: Any) -> bool:
    return isinstance(value, (dist.ProcessGroup, LayoutGroup))


def group_values(value: Any) -> list[Any]:
    """The groups inside ``value``: itself, or the members of a list, tuple or dict (one level)."""
    if is_group(value):
        return [value]
    return [v for _, v in children(value) or () if is_group(v)]


@dataclass(frozen=True, kw_only=True)
class GroupCount:
    """One count: groups torch has registered, and the integration's groups still alive."""

    registered: int  # entries of torch's group map (the default group included)
    alive: int  # groups the integration built, of any generation, still referenced by something
    built: int  # groups the integration built so far, in all generations


class GroupCensus:
    def __init__(self) -> None:
        self._refs: list[weakref.ref[dist.ProcessGroup]] = []
        self._built = 0

    def track(self, groups: list[dist.ProcessGroup]) -> None:
        seen = {id(r()) for r in self._refs if r() is not None}
        for g in groups:
            if id(g) not in seen:
                self._refs.append(weakref.ref(g))
                seen.add(id(g))
                self._built += 1

    def count(self) -> GroupCount:
        gc.collect()  # a cycle (a module and its bound methods) may hold a group until collected
        self._refs = [r for r in self._refs if r() is not None]
        return GroupCount(registered=len(c10d._world.pg_map), alive=len(self._refs), built=self._built)

    def holders(self) -> list[str]:
        """For a report: each group still alive (its Megatron name) and what refers to it.

        A holder outside Python's view (an autograd graph's C++ nodes, a future)
        shows as a bare ``cell`` or nothing: the usual one is a step's loss kept
        alive with its graph, whose Megatron functions saved their groups.
        """
        names: set[str] = set()
        for r in self._refs:
            g = r()
            if g is None:
                continue
            names.add(f"group {getattr(g, 'group_desc', '?')}")
            for h in gc.get_referrers(g):
                if isinstance(h, dict):  # an object's __dict__ or a module's globals: name the key and its owner
                    keys = [str(k) for k, v in h.items() if v is g][:3]
                    owners = [type(o).__name__ for o in gc.get_referrers(h) if not isinstance(o, (list, dict))][:2]
                    names.add(f"dict[{','.join(keys)}] of {','.join(owners) or '?'}")
                elif type(h).__name__ == "frame":
                    names.add(f"frame {h.f_code.co_name} ({h.f_code.co_filename.rsplit('/', 1)[-1]}:{h.f_lineno})")
                elif not isinstance(h, list):
                    names.add(type(h).__name__)
            del g
        return sorted(names)


def snapshot_module_state(module: ModuleType) -> dict[str, Any]:
    """The module's private upper-case globals (``_TENSOR_MODEL_PARALLEL_GROUP`` and so on), copied."""
    return {k: copy.copy(v) for k, v in vars(module).items()
            if k.startswith("_") and k.lstrip("_").isupper() and _plain_or_empty(v)}


def reset_module_state(module: ModuleType, pristine: dict[str, Any]) -> list[str]:
    """Puts every global of ``pristine`` back; returns the names that had not been reset (stale ones)."""
    stale = []
    for name, value in pristine.items():
        now = getattr(module, name, None)
        if not _same(now, value):
            stale.append(name)
            setattr(module, name, copy.copy(value))
    return sorted(stale)


def _plain_or_empty(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (isinstance(v, (list, dict, tuple)) and not v)


def _same(a: Any, b: Any) -> bool:
    return (a is None and b is None) or (type(a) is type(b) and not isinstance(a, (list, dict)) and a == b) or \
        (isinstance(a, (list, dict)) and isinstance(b, (list, dict)) and not a and not b)
