"""Data-parallel gradient averaging with a fixed layout.

All gradients are packed into one flat buffer in parameter order and reduced
in a single all-reduce. The layout never changes, across steps and across
generations, so the reduction cuts the data the same way every time and its
result is reproducible bit for bit (a DDP rebuilt after a recovery starts again
from its first bucket grouping, which changes the reduction order).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["GradientAverager"]


class GradientAverager:
    """``averager()`` all-reduces and averages the gradients of ``params`` in place."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters to average")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one dtype expected, got {sorted(map(str, dtypes))}")
        self._flat: torch.Tensor | None = None

    def __call__(self, group: dist.ProcessGroup | None = None) -> None:
        world = dist.get_world_size(group)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self._flat is None or self._flat.device != grads[0].device:
            self._flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
        flat = self._flat
        offset = 0
        for g in grads:
            flat[offset : offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        if world > 1:
            dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for p, g in zip(self.params, grads):
            view = flat[offset : offset + g.numel()].view_as(g)
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
            offset += g.numel()
