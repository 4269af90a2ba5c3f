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
step waits for it (on the device). A thread issues it in chunks, a couple
ahead of the copy engine, so a small copy to the host the step makes itself
(``loss.item()``) is not queued behind the whole snapshot. The snapshot counts
as held once its copy has completed.

A state dict is split into a *skeleton* (its plain data, with each tensor
replaced by a :class:`TensorRef`) and a flat list of tensors.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

import torch

from checkpointing.tree import map_leaves

__all__ = ["HostSnapshot", "TensorRef", "flatten", "unflatten"]


@dataclass(frozen=True)
class TensorRef:
    index: int


def flatten(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """Returns ``(skeleton, tensors)``; dicts, lists and tuples are walked."""
    tensors: list[torch.Tensor] = []

    def leaf(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return TensorRef(len(tensors) - 1)
        return copy.deepcopy(node)

    return map_leaves(leaf, tree), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return map_leaves(lambda node: tensors[node.index] if isinstance(node, TensorRef) else node, skeleton)


def _layout(tensors: list[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype]]:
    return [(t.shape, t.dtype) for t in tensors]


CHUNK_MB = 64.0  # a copy the compute stream queues behind one chunk waits about a millisecond


class HostSnapshot:
    """One step boundary of the replicated state in host memory, plus the rank's local state of it."""

    def __init__(self, *, chunk_mb: float = CHUNK_MB) -> None:
        self._step: int | None = None
        self._copying: int | None = None  # a GPU copy in flight for this step
        self.skeleton: Any = None
        self.buffers: list[torch.Tensor] = []
        self.local: bytes = b""
        self._chunk = max(1, int(chunk_mb * 2**20))
        self._copier: _PacedCopier | None = None

    @property
    def step(self) -> int | None:
        """The step held, once its copy has completed."""
        if self._copying is not None and self._copier is not None and self._copier.finished():
            self._step, self._copying = self._copying, None
        return self._step

    def capture(self, step: int, replicated: Any, local: bytes) -> None:
        skeleton, tensors = flatten(replicated)
        if self._copier is not None:
            self._copier.wait_issued()  # the last copy must not race this one into the same buffers
        if _layout(tensors) != _layout(self.buffers):
            # The layout changes rarely (an optimizer creates its state on its first step).
            self.buffers = [_host_buffer(t) for t in tensors]
        self._step = None  # the buffers are being overwritten
        cuda = [(self.buffers[i], t.detach()) for i, t in enumerate(tensors) if t.is_cuda]
        for buf, t in zip(self.buffers, tensors):
            if not t.is_cuda:
                buf.copy_(t.detach())
        self.skeleton, self.local = skeleton, local
        if not cuda:
            self._step = step
            return
        if self._copier is None:
            self._copier = _PacedCopier(cuda[0][1].device, self._chunk)
        self._copier.start(cuda)
        self._copying = step

    def before_update(self) -> None:
        """Called before the optimizer changes the state: it waits (on the device) for a copy in flight."""
        if self._copying is not None and self._copier is not None:
            self._copier.make_current_stream_wait()

    def copy_seconds(self) -> float | None:
        """How long the last device-to-host copy took on its side stream (None on CPU)."""
        return self._copier.seconds() if self._copier is not None else None

    def synchronize(self) -> None:
        if self._copier is not None:
            self._copier.wait_finished()
        _ = self.step

    def replicated(self) -> Any:
        """A fresh copy of the replicated state, safe to hand to ``load_state_dict``."""
        self.synchronize()
        assert self._step is not None, "no snapshot held"
        return unflatten(self.skeleton, [b.clone() for b in self.buffers])

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class _PacedCopier:
    """Issues a device-to-host copy chunk by chunk, at most two chunks ahead of the copy engine.

    Copies to the host go through the GPU's copy engine in the order they were
    issued, whatever their stream: a 9 GB snapshot issued at once makes every
    later device-to-host copy wait for all of it, the one-scalar read of a
    ``loss.item()`` included, and the compute stream then stalls behind it
    (measured on an H200: a fully overlapped copy became fully serial). Paced by
    a thread, a compute-stream copy waits for one chunk at most.
    """

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        self._stream = torch.cuda.Stream(device=device)
        self._device = device
        self._chunk = chunk_bytes
        self._issued = threading.Event()
        self._issued.set()
        self._thread: threading.Thread | None = None
        self._begun: Any = None
        self._done: Any = None

    def start(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.wait_issued()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._device))  # after the optimizer step that ended the boundary
        pieces = []
        for dst, src in pairs:
            d, s = dst.view(-1), src.reshape(-1)
            per = max(1, self._chunk // max(1, s.element_size()))
            pieces.extend((d[a:a + per], s[a:a + per]) for a in range(0, s.numel(), per))
        self._issued.clear()
        self._thread = threading.Thread(target=self._run, args=(ready, pieces), name="rt-snapshot-copier", daemon=True)
        self._thread.start()

    def _run(self, ready: Any, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            torch.cuda.set_device(self._device)
            stream = self._stream
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                self._begun = torch.cuda.Event(enable_timing=True)
                self._begun.record(stream)
                behind: list[Any] = []
                for dst, src in pieces:
                    dst.copy_(src, non_blocking=True)
                    marker = torch.cuda.Event()
                    marker.record(stream)
                    behind.append(marker)
                    if len(behind) > 2:
                        behind.pop(0).synchronize()  # this thread waits; the GIL is released while it does
                self._done = torch.cuda.Event(enable_timing=True)
                self._done.record(stream)
        finally:
            self._issued.set()

    def wait_issued(self, timeout: float = 600.0) -> None:
        if not self._issued.wait(timeout):
            raise TimeoutError(f"the snapshot copy was not issued in {timeout:g} s")

    def make_current_stream_wait(self) -> None:
        """The current stream waits (on the device) for the whole copy: every chunk must be issued first."""
        self.wait_issued()
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)

    def finished(self) -> bool:
        return self._issued.is_set() and self._done is not None and self._done.query()

    def wait_finished(self) -> None:
        self.wait_issued()
        if self._done is not None:
            self._done.synchronize()

    def seconds(self) -> float | None:
        self.wait_finished()
        if self._begun is None or self._done is None:
            return None
        return self._begun.elapsed_time(self._done) / 1000


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    if t.is_cuda:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format)
