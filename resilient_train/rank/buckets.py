"""The fixed bucket plan of the gradient reduction: which parameters each bucket holds, in reduction order.

Made once from the parameters alone: in reverse order (about the order their
gradients become ready in backward), cut into buckets of about ``bucket_mb``
by torch's own rule (``dist._compute_bucket_assignment_by_size``, the one DDP
rebuilds its buckets with, so a DDP handed the parameters in this order
rebuilds onto exactly this plan: :func:`resilient_train.rank.ddp.fix_buckets`). It
never depends on the order gradients became ready, so it is the same in every
generation and on every rank.

Parameters of several floating-point dtypes (an fp32 norm beside bf16
weights) are fine: torch's rule never puts two dtypes in one bucket, so each
bucket is one flat buffer of one dtype, in the plan and in DDP alike.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from resilient_train.rank.errors import UsageError

__all__ = ["BucketPlan", "DEFAULT_BUCKET_MB"]

DEFAULT_BUCKET_MB = 25.0  # DDP's default bucket size


class BucketPlan:
    """Which parameters each bucket holds, and where, in reduction order."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        seen: set[int] = set()
        # Deduplicated like DDP's own list (a shared parameter once, where it first appears), then reversed.
        ordered = [p for p in params if p.requires_grad and id(p) not in seen and not seen.add(id(p))]  # type: ignore[func-returns-value]
        if not ordered:
            raise UsageError("no trainable parameters to reduce")
        bad = sorted({str(p.dtype) for p in ordered if not p.dtype.is_floating_point})
        if bad:
            raise UsageError(f"the gradient reduction takes real floating-point parameters, got {bad} "
                             "(parameters of several floating-point dtypes are fine)")
        self.bucket_mb = bucket_mb
        self.order = ordered[::-1]
        cap = max(1, int(bucket_mb * 2**20))
        assignment, _ = dist._compute_bucket_assignment_by_size(
            self.order, [cap], [False] * len(self.order), list(range(len(self.order))))
        self.buckets: list[list[int]] = [list(b) for b in assignment]  # indices into ``order``
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, element offset in it)
        self.numel: list[int] = []
        for b, members in enumerate(self.buckets):
            offset = 0
            for i in members:
                self.where[id(self.order[i])] = (b, offset)
                offset += self.order[i].numel()
            self.numel.append(offset)

    def __len__(self) -> int:
        return len(self.buckets)

    def params(self, b: int) -> list[torch.nn.Parameter]:
        return [self.order[i] for i in self.buckets[b]]

    def views(self, flat: torch.Tensor, b: int) -> list[torch.Tensor]:
        """Each parameter's gradient in bucket ``b``'s flat buffer ``flat``."""
        out, offset = [], 0
        for p in self.params(b):
            out.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def holds(self, b: int, params: Sequence[torch.Tensor]) -> bool:
        """Whether ``params`` are exactly bucket ``b``'s, in its order."""
        mine = self.buckets[b] if b < len(self.buckets) else None
        return mine is not None and len(mine) == len(params) and all(
            self.order[i] is p for i, p in zip(mine, params))
