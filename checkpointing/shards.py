"""Sharded tensors (DTensor) in a checkpoint: each rank writes the chunk it holds, with its place in the whole.

A DTensor leaf of a saved state is one rank's piece of a global tensor. The
rank writes its local tensor as one chunk, with the chunk's offsets and the
global size, as a ``SHARD`` item of DCP's metadata; the commit merges the
chunks of one key from every rank's metadata piece and checks that they tile
the tensor exactly (:func:`check_tiling`), so a checkpoint with a missing or
doubled chunk is never committed. A chunk several ranks hold is written by one
of them: along a ``Replicate`` placement of its mesh, the rank at coordinate 0;
along a replicate dimension of the job's layout that the DTensor's mesh does
not know (TP × DP: a DTensor on the ``tp`` sub-mesh), the caller says which
ranks are the first replica (``primary``).

Reading is DCP's: into a template of any layout (a DTensor on another mesh,
or a whole tensor), each rank reading only the stored chunks that overlap what
it holds. Nothing here runs a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Chunk", "check_tiling", "is_dtensor", "rank_share"]


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """Where a local tensor lies in its global tensor."""

    size: tuple[int, ...]  # the global tensor's shape
    offsets: tuple[int, ...]

    def to_json(self) -> dict[str, list[int]]:
        return {"size": list(self.size), "offsets": list(self.offsets)}

    @classmethod
    def from_json(cls, data: Any) -> "Chunk":
        if not isinstance(data, dict):
            raise ValueError(f"a chunk must be an object, got {type(data).__name__}")
        size, offsets = data.get("size"), data.get("offsets")
        if not (_ints(size) and _ints(offsets) and len(size) == len(offsets)):
            raise ValueError(f"a chunk needs integer size and offsets of one length, got {data!r}")
        return cls(size=tuple(size), offsets=tuple(offsets))

    def check_holds(self, key: str, local_shape: tuple[int, ...]) -> None:
        """``ValueError`` unless a local tensor of ``local_shape`` at these offsets lies inside the global tensor."""
        if len(local_shape) != len(self.size) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(self.offsets, local_shape, self.size)):
            raise ValueError(f"chunk of {key!r}: {list(local_shape)} at {list(self.offsets)} does not lie inside "
                             f"{list(self.size)}")


def _ints(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return False
    return isinstance(t, DTensor)


def _local_chunk(key: str, t: Any) -> tuple[torch.Tensor, Chunk] | None:
    """This rank's chunk of DTensor ``t`` to write, or None when another rank writes the same one."""
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not on the tensor's mesh
        return None
    for dim, placement in enumerate(t.placements):
        if placement.is_partial():
            raise ValueError(f"checkpoint state at {key!r}: a DTensor with a pending reduction (Partial) cannot "
                             "be saved; reduce it first")
        if placement.is_replicate() and coordinate[dim] != 0:
            return None  # a replica of the chunk the rank at coordinate 0 writes
    boxes = t.__create_chunk_list__()  # DCP's own: this rank's box in the global tensor
    assert len(boxes) == 1, (key, boxes)
    local = t.to_local().detach()
    if local.numel() == 0 and any(coordinate):
        return None  # an empty piece (uneven sharding); the rank at the origin writes one if all are empty
    return local, Chunk(size=tuple(t.shape), offsets=tuple(int(o) for o in boxes[0].offsets))


def rank_share(flat: dict[str, Any], *, rank: int, primary: bool = True
               ) -> tuple[dict[str, torch.Tensor], dict[str, Chunk]]:
    """What this rank writes of a flattened state: the plain tensors on rank 0 (every rank holds them the
    same), and on a ``primary`` rank the chunks of the DTensors it is the first holder of.

    Returns ``(tensors by key, chunks by key)``; a key in ``chunks`` is written as a chunk of a larger tensor.
    """
    tensors: dict[str, torch.Tensor] = {}
    chunks: dict[str, Chunk] = {}
    for key, t in flat.items():
        if not is_dtensor(t):
            if rank == 0:
                tensors[key] = t
            continue
        if not primary:
            continue
        mine = _local_chunk(key, t)
        if mine is not None:
            tensors[key], chunks[key] = mine
    return tensors, chunks


def check_tiling(key: str, size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """None when ``boxes`` (``(offsets, sizes)`` each) tile a tensor of ``size`` exactly, else why not.

    Each box must lie inside the tensor, no two may overlap, and their volumes must add up to the
    tensor's: then every element is stored exactly once. Sorted along the first dimension, a box is
    compared only with the boxes that start before it ends there (FSDP's row shards: one neighbour each).
    """
    total = _volume(size)
    covered = 0
    live = []
    for offsets, sizes in boxes:
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size)):
            return f"{key!r}: chunk {list(sizes)} at {list(offsets)} does not lie inside {list(size)}"
        v = _volume(sizes)
        covered += v
        if v:
            live.append((tuple(offsets), tuple(sizes)))
    if not size:  # a 0-d tensor: one chunk of one element
        return None if covered == 1 else f"{key!r}: {len(live)} chunks of a 0-d tensor"
    live.sort()
    for i, (oi, si) in enumerate(live):
        for oj, sj in live[i + 1:]:
            if oj[0] >= oi[0] + si[0]:
                break
            if all(a < c + d and c < a + b for a, b, c, d in zip(oi, si, oj, sj)):
                return f"{key!r}: chunks at {list(oi)} and {list(oj)} overlap (written twice?)"
    if covered != total:
        return f"{key!r}: the chunks hold {covered} of its {total} elements (a rank's chunk is missing)"
    return None


def _volume(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
