"""Host snapshots of the replicated state: an option for what live replicas can't cover.

Live replicas are the redundancy of data parallelism (docs/design.md); a host
snapshot (``SupervisorConfig(snapshot_every=k)``) adds a copy of the model
and optimizer in this process's host memory every ``k`` steps, for faults
that leave no live replica of a recoverable step (every survivor torn in its
optimizer update, a job of one rank). It costs a full copy of the state in
host memory.

On a GPU the copy runs on a side stream into pinned buffers allocated once:
the side stream waits for the optimizer step that ends the boundary, the copy
overlaps the next step's forward and backward, and only the next optimizer
step waits for it (on the device, without the host waiting). The snapshot
counts as held once its copy has completed.

A state dict is split into a *skeleton* (its plain data, with each tensor
replaced by a :class:`TensorRef`) and a flat list of tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostSnapshot", "TensorRef", "flatten", "unflatten"]


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


class HostSnapshot:
    """One step boundary of the replicated state in host memory, plus the rank's local state of it."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._copying: int | None = None  # a GPU copy in flight for this step
        self.skeleton: Any = None
        self.buffers: list[torch.Tensor] = []
        self.local: bytes = b""
        self._stream: Any = None
        self._done: Any = None  # torch.cuda.Event of the copy in flight
        self._begun: Any = None

    @property
    def step(self) -> int | None:
        """The step held, once its copy has completed."""
        if self._copying is not None and self._done is not None and self._done.query():
            self._step, self._copying = self._copying, None
        return self._step

    def capture(self, step: int, replicated: Any, local: bytes) -> None:
        skeleton, tensors = flatten(replicated)
        if _layout(tensors) != _layout(self.buffers):
            # The layout changes rarely (an optimizer creates its state on its first step).
            self.buffers = [_host_buffer(t) for t in tensors]
        self._step = None  # the buffers are being overwritten
        cuda = [i for i, t in enumerate(tensors) if t.is_cuda]
        for i, t in enumerate(tensors):
            if not t.is_cuda:
                self.buffers[i].copy_(t.detach())
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=tensors[cuda[0]].device)
            self._stream.wait_stream(torch.cuda.current_stream(tensors[cuda[0]].device))
            with torch.cuda.stream(self._stream):
                self._begun = torch.cuda.Event(enable_timing=True)
                self._begun.record(self._stream)
                torch._foreach_copy_([self.buffers[i] for i in cuda], [tensors[i].detach() for i in cuda],
                                     non_blocking=True)
                self._done = torch.cuda.Event(enable_timing=True)
                self._done.record(self._stream)
            self._copying = step
        else:
            self._step = step
        self.skeleton, self.local = skeleton, local

    def before_update(self) -> None:
        """Called before the optimizer changes the state: it must wait for a copy in flight (on the device)."""
        if self._copying is not None and self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)

    def copy_seconds(self) -> float | None:
        """How long the last device-to-host copy took on its side stream (None on CPU)."""
        if self._done is None or self._begun is None:
            return None
        self._done.synchronize()
        return self._begun.elapsed_time(self._done) / 1000

    def synchronize(self) -> None:
        if self._done is not None:
            self._done.synchronize()
        _ = self.step

    def replicated(self) -> Any:
        """A fresh copy of the replicated state, safe to hand to ``load_state_dict``."""
        self.synchronize()
        assert self._step is not None, "no snapshot held"
        return unflatten(self.skeleton, [b.clone() for b in self.buffers])

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    if t.is_cuda:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format)
