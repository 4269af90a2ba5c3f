"""Healing: ranks that lost the replicated state copy it from a live replica, point to point.

Only the ranks that need the state receive it, each from one source (the plan
spreads targets over the holders), so a lost rank costs one copy of the state
over the network, whatever the world size. A source sends a header (the
state's plain data, with each tensor's shape, dtype and device) and then the
tensors, packed into buffers of at most ``bucket_mb`` per dtype so the
transfer is a handful of sends however many parameters the model has, and
never holds a second copy of the whole state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from resilient_train.local_state import decode_local, encode_local
from resilient_train.snapshot import TensorRef, flatten, unflatten

__all__ = ["send_state", "receive_state"]

BUCKET_MB = 64.0


def _buckets(layout: list[tuple[tuple[int, ...], torch.dtype, str]], bucket_bytes: int) -> list[list[int]]:
    """Groups tensor indices by dtype into runs of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype, _) in enumerate(layout):
        by_dtype.setdefault(dtype, []).append(i)
    out: list[list[int]] = []
    for dtype, indices in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        run: list[int] = []
        size = 0
        for i in indices:
            n = _numel(layout[i][0]) * dtype.itemsize
            if run and size + n > bucket_bytes:
                out.append(run)
                run, size = [], 0
            run.append(i)
            size += n
        if run:
            out.append(run)
    return out


_REF = "__rt_tensor__"


def _plain(node: Any) -> Any:
    """The skeleton with its tensor references as plain dicts (the header is read with weights_only)."""
    if isinstance(node, TensorRef):
        return {_REF: node.index}
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_plain(v) for v in node)
    return node


def _refs(node: Any) -> Any:
    if isinstance(node, dict):
        if len(node) == 1 and _REF in node:
            return TensorRef(int(node[_REF]))
        return {k: _refs(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_refs(v) for v in node)
    return node


def send_state(state: Any, dst: int, *, device: torch.device) -> int:
    """Sends ``state`` (a state dict) to ``dst``; returns the bytes sent."""
    skeleton, tensors = flatten(state)
    layout = [(tuple(t.shape), t.dtype, t.device.type) for t in tensors]
    header = encode_local({"skeleton": _plain(skeleton),
                           "layout": [(s, str(d).removeprefix("torch."), k) for s, d, k in layout]})
    blob = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    dist.send(torch.tensor([blob.numel()], dtype=torch.int64, device=device), dst)
    dist.send(blob, dst)
    sent = blob.numel()
    for run in _buckets(layout, int(BUCKET_MB * 2**20)):
        if len(run) == 1 and tensors[run[0]].device == device and tensors[run[0]].is_contiguous():
            flat = tensors[run[0]].detach().reshape(-1)
        else:
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in run])
        dist.send(_wire(flat), dst)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_state(src: int, *, device: torch.device) -> tuple[Any, int]:
    """Receives what :func:`send_state` sends from ``src``; returns the state and the bytes received."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    blob = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(blob, src)
    # The header is plain data from a peer of the same job, read with weights_only.
    header = decode_local(blob.cpu().numpy().tobytes())
    layout = [(tuple(s), getattr(torch, d), k) for s, d, k in header["layout"]]
    out: list[torch.Tensor | None] = [None] * len(layout)
    received = blob.numel()
    for run in _buckets(layout, int(BUCKET_MB * 2**20)):
        dtype = layout[run[0]][1]
        sizes = [_numel(layout[i][0]) for i in run]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.recv(_wire(flat), src)
        received += flat.numel() * flat.element_size()
        for i, piece in zip(run, torch.split(flat, sizes)):
            target = "cpu" if layout[i][2] == "cpu" else device
            out[i] = piece.view(layout[i][0]).to(target, copy=True)
    return unflatten(_refs(header["skeleton"]), out), received  # type: ignore[arg-type]


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no bool type; the bytes travel the same.
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
