"""Bitwise comparison of two states: the test of "same result with and without faults"."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from checkpointing.state_files import read_state
from checkpointing.tree import Gap, GapKind, KeyPath, pairs

__all__ = ["diff_all", "diff_states"]

StateLike = dict[str, Any] | str | os.PathLike[str]


def diff_states(a: StateLike, b: StateLike) -> str | None:
    """``None`` when ``a`` and ``b`` are bitwise equal, else a one-line description of the first difference.

    Each side is a state dict or a committed checkpoint directory (verified, then
    read with every rank's own entries; the manifest extras are compared too).
    Tensors compare by dtype, shape, then bits (so NaNs with equal bits are equal
    and ``0.0`` differs from ``-0.0``); plain values by type and value.
    """
    return next(iter(diff_all(a, b)), None)


def diff_all(a: StateLike, b: StateLike) -> list[str]:
    """Every difference between ``a`` and ``b``, one line each (empty when bitwise equal)."""
    sa, sb = _as_state(a), _as_state(b)
    return [_explain(d) for d in _diffs(sa, sb)]


_UNSEEDED = re.compile(r"\.rng\.(python|numpy)[.:]")


def _explain(line: str) -> str:
    """A difference in ``random``'s or NumPy's state says what usually causes it."""
    m = _UNSEEDED.search(line)
    if m is None:
        return line
    name = {"python": "random", "numpy": "NumPy"}[m.group(1)]
    return (f"{line} (the {name} RNG: the script draws from it without seeding it the same way in both runs; "
            f"seed it, or stop using it)")


def _as_state(x: StateLike) -> Any:
    if isinstance(x, dict):
        return x
    if isinstance(x, (str, os.PathLike)):
        state, manifest = read_state(Path(x))
        return {"state": state, "extras": manifest.extras}
    raise ValueError(f"diff_states: expected a state dict or a checkpoint directory, got {type(x).__name__}")


def _diffs(a: Any, b: Any) -> Iterator[str]:
    """Every difference, in order (lazily: the first costs only what comes before it)."""
    for p in pairs(a, b):
        where = _dotted(p.path) or "<root>"
        if isinstance(p, Gap):
            if p.kind is GapKind.ONLY_A:
                yield f"{_dotted(p.path)}: only in the first state"
            elif p.kind is GapKind.ONLY_B:
                yield f"{_dotted(p.path)}: only in the second state"
            elif p.kind is GapKind.KIND:
                yield f"{where}: {_kind(p.a)} vs {_kind(p.b)}"
            else:
                yield f"{where}: length {len(p.a)} vs {len(p.b)}"
        else:
            d = _diff_leaf(p.a, p.b, where)
            if d is not None:
                yield d


def _diff_leaf(a: Any, b: Any, where: str) -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {_kind(a)} vs {_kind(b)}"
        return _diff_tensor(a, b, where)
    if type(a) is not type(b):
        return f"{where}: {_kind(a)} {_short(a)} vs {_kind(b)} {_short(b)}"
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    if isinstance(a, float) and a == b and math.copysign(1.0, a) != math.copysign(1.0, b):
        return f"{where}: {a!r} vs {b!r} (sign of zero)"
    if a != b:
        return f"{where}: {_short(a)} vs {_short(b)}"
    return None


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


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


def _dotted(path: KeyPath) -> str:
    """A place as the dotted name a checkpoint's flattening gives it."""
    dotted = ""
    for key in path:
        dotted = f"{dotted}.{key}" if dotted else str(key)
    return dotted


def _kind(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor({x.dtype}, {tuple(x.shape)})"
    return type(x).__name__
