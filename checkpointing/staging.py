"""Staging: copy the live state into host buffers that are allocated once and reused.

Each buffer is an anonymous memory file (``memfd``) mapped shared, so the writer
process maps the same pages through ``/proc/<pid>/fd/<n>`` and writes them without
another copy; nothing is named in a file system, so nothing leaks when a process
is killed. On GPU they are shared memory registered as pinned
(``cudaHostRegister``), filled by non-blocking copies; ``ready`` is a CUDA event
the writer side waits on, so the training stream never blocks on the copy.
New buffers are made only when the set of tensors, or a shape or dtype, changes.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

__all__ = ["HostStager", "StagedTensors", "map_buffer"]

StagedTensors = dict[str, torch.Tensor]


def map_buffer(path: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Maps a staging buffer (shared, no copy), e.g. ``/proc/<pid>/fd/<n>``; empty tensors need no file."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


class HostStager:
    def __init__(self) -> None:
        self._buffers: StagedTensors = {}
        self._layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
        self._registered: list[torch.Tensor] = []
        self._fds: dict[str, int] = {}
        self.layout_version = 0

    @property
    def buffers(self) -> StagedTensors:
        return self._buffers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def prepare(self, tensors: dict[str, torch.Tensor]) -> None:
        """Allocates (and faults in) the buffers for this layout ahead of the first save."""
        layout = tuple((k, tuple(t.shape), t.dtype) for k, t in tensors.items())
        if layout != self._layout:
            self._allocate(tensors)
            self._layout = layout
            for buf in self._buffers.values():
                buf.zero_()

    def stage(
        self, tensors: dict[str, torch.Tensor], *, midway: Callable[[], None] | None = None
    ) -> torch.cuda.Event | None:
        """Copies ``tensors`` into the buffers; returns a CUDA event when copies are still in flight."""
        layout = tuple((k, tuple(t.shape), t.dtype) for k, t in tensors.items())
        if layout != self._layout:
            self._allocate(tensors)
            self._layout = layout
        any_cuda = False
        half = len(tensors) // 2
        for i, (key, src) in enumerate(tensors.items()):
            if i == half and midway is not None:
                midway()
            dst = self._buffers[key]
            if src.is_cuda:
                any_cuda = True
                dst.copy_(src.detach(), non_blocking=True)
            else:
                dst.copy_(src.detach())
        if any_cuda:
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    def _allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        self.release()
        buffers: StagedTensors = {}
        for key, src in tensors.items():
            nbytes = src.numel() * src.element_size()
            if nbytes:
                fd = os.memfd_create(f"ckpt-stage-{len(buffers)}", os.MFD_CLOEXEC)
                os.ftruncate(fd, nbytes)
                self._fds[key] = fd
            path = f"/proc/self/fd/{self._fds[key]}" if nbytes else ""
            buf = map_buffer(path, src.dtype, list(src.shape))
            if src.is_cuda and nbytes:
                self._pin(buf)
            buffers[key] = buf
        self._buffers = buffers
        self.layout_version += 1

    def _pin(self, buf: torch.Tensor) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
        if int(err) == 0:
            self._registered.append(buf)

    def release(self) -> None:
        if self._registered:
            cudart = torch.cuda.cudart()
            for buf in self._registered:
                cudart.cudaHostUnregister(buf.data_ptr())
        self._registered = []
        self._buffers = {}
        self._layout = ()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def describe(self) -> list[dict[str, Any]]:
        """How another process maps the buffers: key, path, dtype, shape."""
        pid = os.getpid()
        return [
            {
                "key": key,
                "path": f"/proc/{pid}/fd/{self._fds[key]}" if key in self._fds else "",
                "dtype": str(buf.dtype).removeprefix("torch."),
                "shape": list(buf.shape),
            }
            for key, buf in self._buffers.items()
        ]
