"""Healing: a replacement rank copies the replicated state from a healthy peer.

The source sends the skeleton (plain data and tensor shapes) and then the
tensors, packed into one flat buffer per dtype so the transfer is a handful of
broadcasts however many parameters the model has.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from resilient_train.snapshot import flatten, unflatten

__all__ = ["broadcast_state"]


def broadcast_state(state: Any | None, *, src: int, device: torch.device) -> Any:
    """Collective: every rank of the default group calls it; returns the source's state."""
    is_src = dist.get_rank() == src
    if is_src:
        assert state is not None, "the healing source has no state"
        skeleton, tensors = flatten(state)
        layout = [(tuple(t.shape), t.dtype) for t in tensors]
        header: list[Any] = [(skeleton, layout)]
    else:
        header = [None]
    # The skeleton is plain data from a peer of the same job, not from disk.
    dist.broadcast_object_list(header, src=src, device=device if device.type == "cuda" else None)
    skeleton, layout = header[0]

    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype) in enumerate(layout):
        by_dtype.setdefault(dtype, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(layout)
    for dtype, indices in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        sizes = [_numel(layout[i][0]) for i in indices]
        if is_src:
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in indices])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        # gloo has no bool reduction types; bytes travel the same.
        dist.broadcast(flat.view(torch.uint8) if dtype == torch.bool else flat, src=src)
        for i, piece in zip(indices, torch.split(flat, sizes)):
            out[i] = piece.view(layout[i][0]).clone()
    return unflatten(skeleton, out)  # type: ignore[arg-type]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
