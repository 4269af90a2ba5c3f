"""Bitwise comparison of two states: the test of "same result with and without faults"."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from checkpointing.state_files import read_state

__all__ = ["diff_states"]

StateLike = dict[str, Any] | str | os.PathLike[str]


def diff_states(a: StateLike, b: StateLike) -> str | None:
    """``None`` when ``a`` and ``b`` are bitwise equal, else a one-line description of the first difference.

    Each side is a state dict or a committed checkpoint directory (verified, then
    read with every rank's own entries; the manifest extras are compared too).
    Tensors compare by dtype, shape, then bits (so NaNs with equal bits are equal
    and ``0.0`` differs from ``-0.0``); plain values by type and value.
    """
    sa, sb = _as_state(a), _as_state(b)
    return _diff(sa, sb, "")


def _as_state(x: StateLike) -> Any:
    if isinstance(x, dict):
        return x
    if isinstance(x, (str, os.PathLike)):
        state, manifest = read_state(Path(x))
        return {"state": state, "extras": manifest.extras}
    raise ValueError(f"diff_states: expected a state dict or a checkpoint directory, got {type(x).__name__}")


def _diff(a: Any, b: Any, path: str) -> str | None:
    where = path or "<root>"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {_kind(a)} vs {_kind(b)}"
        return _diff_tensor(a, b, where)
    if isinstance(a, dict) and isinstance(b, dict):
        ka, kb = list(a), list(b)
        only_a = [k for k in ka if k not in b]
        only_b = [k for k in kb if k not in a]
        if only_a or only_b:
            side, key = ("first", only_a[0]) if only_a else ("second", only_b[0])
            return f"{_join(path, key)}: only in the {side} state"
        for k in ka:
            d = _diff(a[k], b[k], _join(path, k))
            if d is not None:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b):
            return f"{where}: {_kind(a)} vs {_kind(b)}"
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _diff(x, y, _join(path, i))
            if d is not None:
                return d
        return None
    if type(a) is not type(b):
        return f"{where}: {_kind(a)} {a!r} vs {_kind(b)} {b!r}"
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    if isinstance(a, float) and a == b and math.copysign(1.0, a) != math.copysign(1.0, b):
        return f"{where}: {a!r} vs {b!r} (sign of zero)"
    if a != b:
        return f"{where}: {a!r} vs {b!r}"
    return None


def _diff_tensor(a: torch.Tensor, b: torch.Tensor, where: str) -> str | None:
    if a.dtype != b.dtype:
        return f"{where}: dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.numel() == 0:
        return None
    if a.dtype == torch.bool:
        ba, bb = a.view(torch.uint8), b.view(torch.uint8)
    else:
        ba, bb = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if torch.equal(ba, bb):
        return None
    itemsize = a.element_size()
    ne = (ba.reshape(-1, itemsize) != bb.reshape(-1, itemsize)).any(dim=1)
    flat_idx = int(ne.nonzero()[0].item())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_idx), a.shape)) if a.dim() else ()
    va, vb = a.reshape(-1)[flat_idx].item(), b.reshape(-1)[flat_idx].item()
    count = int(ne.sum().item())
    msg = f"{where}: {count} of {a.numel()} elements differ; first at index {list(index)}: {va!r} vs {vb!r}"
    if a.is_floating_point() or a.is_complex():
        diff = (a.to(torch.float64) - b.to(torch.float64)).abs() if not a.is_complex() else (a - b).abs()
        msg += f"; max abs diff {diff.nan_to_num(nan=float('inf')).max().item():.6g}"
    return msg


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _kind(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor({x.dtype}, {tuple(x.shape)})"
    return type(x).__name__
