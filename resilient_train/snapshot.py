"""In-memory snapshots of the train state at step boundaries.

A state dict is split into a *skeleton* (its plain data, with each tensor
replaced by a :class:`TensorRef`) and a flat list of tensors. A snapshot copies
the tensors into buffers it allocated once and reuses: a ``copy_`` into a host
buffer on CPU; on GPU an asynchronous copy into pinned host memory, ordered on
the current stream before anything that could modify the source.

:class:`SnapshotRing` keeps the last ``capacity`` step boundaries (two by
default): after a fault some ranks may have finished one more step than others,
and the run resumes from the newest step that every rank still holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Snapshot", "SnapshotRing", "TensorRef", "flatten", "unflatten"]


@dataclass(frozen=True)
class TensorRef:
    index: int


def flatten(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """Returns ``(skeleton, tensors)``; dicts, lists and tuples are walked."""
    tensors: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return TensorRef(len(tensors) - 1)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        return copy.deepcopy(node)

    return walk(tree), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def walk(node: Any) -> Any:
        if isinstance(node, TensorRef):
            return tensors[node.index]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        return node

    return walk(skeleton)


def _layout(tensors: list[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype]]:
    return [(t.shape, t.dtype) for t in tensors]


class Snapshot:
    """One step boundary: a skeleton, host buffers, and the rank-local state."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.skeleton: Any = None
        self.buffers: list[torch.Tensor] = []
        self.local: bytes = b""
        self._pending: torch.cuda.Event | None = None

    def capture(self, step: int, replicated: Any, local: bytes) -> None:
        skeleton, tensors = flatten(replicated)
        if _layout(tensors) != _layout(self.buffers):
            # The layout changes rarely (an optimizer creates its state on its
            # first step); only then are buffers allocated.
            self.buffers = [_host_buffer(t) for t in tensors]
        pending = False
        for buf, t in zip(self.buffers, tensors):
            if t.is_cuda:
                buf.copy_(t.detach(), non_blocking=True)
                pending = True
            else:
                buf.copy_(t.detach())
        if pending:
            self._pending = torch.cuda.Event()
            self._pending.record()
        self.step, self.skeleton, self.local = step, skeleton, local

    def synchronize(self) -> None:
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None

    def replicated(self) -> Any:
        """A fresh copy of the replicated state, safe to hand to ``load_state_dict``."""
        assert self.step is not None, "empty snapshot"
        self.synchronize()
        return unflatten(self.skeleton, [b.clone() for b in self.buffers])

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    if t.is_cuda:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format)


class SnapshotRing:
    """The last ``capacity`` step boundaries, oldest overwritten first."""

    def __init__(self, capacity: int = 2) -> None:
        if capacity < 2:
            raise ValueError(f"a snapshot ring needs at least 2 slots, got {capacity}")
        self._slots = [Snapshot() for _ in range(capacity)]

    def capture(self, step: int, replicated: Any, local: bytes) -> Snapshot:
        slot = self._slot_for(step)
        slot.capture(step, replicated, local)
        return slot

    def _slot_for(self, step: int) -> Snapshot:
        for s in self._slots:
            if s.step == step:
                return s
        empty = [s for s in self._slots if s.step is None]
        if empty:
            return empty[0]
        return min(self._slots, key=lambda s: s.step)  # type: ignore[arg-type,return-value]

    def steps(self) -> list[int]:
        return sorted(s.step for s in self._slots if s.step is not None)

    def get(self, step: int) -> Snapshot:
        for s in self._slots:
            if s.step == step:
                return s
        raise KeyError(f"no snapshot of step {step} (have {self.steps()})")

    def drop_after(self, step: int) -> None:
        """Forgets snapshots newer than ``step`` (after rolling back to it)."""
        for s in self._slots:
            if s.step is not None and s.step > step:
                s.step = None
