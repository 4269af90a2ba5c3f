"""A rank's share of a sharded state, as plain tensors: what heals, what a buddy keeps, what is checksummed.

A DTensor is tied to its mesh, and every generation has a new mesh; its
*local* tensor is what the rank holds. :func:`to_local` turns every DTensor of
a state dict into ``{"__rt_local__": local}`` (plain data and tensors: it
travels through :mod:`resilient_train.rank.heal` and host copies like any state),
and :func:`load_local_into` writes such a state back into the live objects of
the current generation, in place. A rank only ever receives the shards of its
own mesh coordinates (its replica class), so no placement travels.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from checkpointing.tree import leaves, map_leaves
from resilient_train.rank.errors import UsageError

__all__ = ["LOCAL", "checksum", "has_dtensor", "load_local_into", "load_optimizer_local", "to_local"]

LOCAL = "__rt_local__"


def to_local(tree: Any) -> Any:
    return map_leaves(lambda x: {LOCAL: x.to_local().detach()} if isinstance(x, DTensor) else x, tree)


def has_dtensor(tree: Any) -> bool:
    return any(isinstance(x, DTensor) for x in leaves(tree))


def _is_local(node: Any) -> bool:
    return isinstance(node, dict) and len(node) == 1 and LOCAL in node


def load_local_into(live: dict[str, Any], saved: dict[str, Any], *, what: str) -> None:
    """Copies ``saved`` (a :func:`to_local` form of a module state dict) into ``live``'s tensors in place."""
    missing = sorted(set(live) ^ set(saved))
    if missing:
        raise RuntimeError(f"{what}: the healed state and the live one differ in {missing[:3]}")
    with torch.no_grad():
        for key, target in live.items():
            src = saved[key]
            if isinstance(target, DTensor):
                if not _is_local(src):
                    raise RuntimeError(f"{what}: {key} is sharded here and not in the healed state")
                dst = target.to_local()
                src = src[LOCAL]
            else:
                dst = target
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise RuntimeError(f"{what}: {key} is {src.dtype}{list(src.shape)} in the healed state, "
                                   f"{dst.dtype}{list(dst.shape)} here")
            dst.copy_(src)


def load_optimizer_local(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Loads a :func:`to_local` optimizer state dict: each local shard becomes a DTensor of its parameter's layout."""
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def wrap(index: int, name: str, value: Any) -> Any:
        if not _is_local(value):
            return value
        p = params[index]
        local = value[LOCAL]
        if not isinstance(p, DTensor) or p.to_local().shape != local.shape:
            raise UsageError(f"optimizer state {name!r} of parameter {index} is not shaped like its parameter: "
                             "only element-wise optimizer states (SGD, Adam, AdamW, ...) can be healed sharded")
        return DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    state = {int(i): {k: wrap(int(i), k, v) for k, v in s.items()} for i, s in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def checksum(tensors: list[torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes, in order (a flipped bit anywhere changes it)."""
    crc = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        crc = zlib.crc32(data.cpu().numpy().data, crc)
    return crc
