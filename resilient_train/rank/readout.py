"""The step's loss for the ``step_done`` event, read without making the host wait for the device."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LossReadout"]


class LossReadout:
    """A ``loss.item()`` per step would sync the host with the GPU (and, with a host
    snapshot in flight, queue behind its copy); a CUDA loss is copied to pinned
    memory instead and reported once the copy has landed (else left out)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._ready: Any = None
        self._value: float | None = None

    def note(self, out: Any) -> None:
        self._value, self._ready = None, None
        if isinstance(out, torch.Tensor) and out.numel() == 1:
            if out.is_cuda:
                if self._host is None:
                    self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
                self._host.copy_(out.detach().float().reshape(()), non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record()
            else:
                self._value = float(out.detach().float())
        elif isinstance(out, (int, float)):
            self._value = float(out)

    def value(self) -> float | None:
        if self._ready is not None and self._ready.query():
            assert self._host is not None
            self._value, self._ready = float(self._host), None
        return self._value
