"""Rank-local state in the store: written in one place, read in one place.

Each rank publishes the local state of its next step boundary (step, RNG
states, the data position) before its vote on the step goes out, into one of
three ring slots per rank (``step % RING``). A replacement takes over the
state its predecessor published. A host snapshot's local state has a slot of
its own.

Why three. The members of a step may not all commit it: the vote's
reduction completes everywhere, but a rank that learns of a failure right
after it (its generation woken, or its agent's store moved) gives the step
up, while another commits it and starts the next, publishing the boundary
after that. So a rank lost then is at most one boundary past the survivors,
and has published one more: with its parameters at boundary c, its slots
hold c - 1 (where the survivors may be), c and c + 1. It cannot commit c + 1
without the survivors' votes. Two slots lost c - 1 in that case, and the
survivors' resume step with it (seen when node 0's agent was stopped and
its rank ran on: the survivors gave up a step that rank committed).

A slot holds ``b"<step>\\n" + payload``; the payload is ``torch.save`` output
read back with ``weights_only=True``: plain data and tensors, nothing executed.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from checkpointing.tree import Pair, pairs

__all__ = ["LocalSlots", "as_peer", "decode_local", "encode_local", "same_local"]


def encode_local(sd: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf, _use_new_zipfile_serialization=False)  # a third faster for a few KB; loads the same
    return buf.getvalue()


def decode_local(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)


class LocalSlots:
    """The published local states of every rank, through one store."""

    RING = 3  # boundaries kept per rank (the module's docstring says why three)

    SNAPSHOT = "snap"
    SNAPSHOTS = ("snap", "snap1")  # two: buddy refreshes keep the newest two boundaries (resilient_train.rank.buddy)

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        # The step each slot holds, for the slots this process wrote or read: only a rank's own process writes
        # its slots, so what it knows of them stays true, and a survivor joining a generation asks the store
        # nothing (a replacement reads its predecessor's slots once).
        self._known: dict[tuple[int, int | str], int | None] = {}
        # Many nodes: where each published state is copied too (resilient_train.rank.storemirror).
        self.mirror: Any = None

    @staticmethod
    def key(rank: int, slot: int | str) -> str:
        return f"rt/local/{rank}/{slot}"

    def publish(self, rank: int, step: int, payload: bytes, *, snapshot: bool = False) -> None:
        slot: int | str = step % self.RING
        if snapshot:
            held = {s: self._step_in(rank, s) for s in self.SNAPSHOTS}
            same = [s for s, h in held.items() if h == step]
            empty = [s for s, h in held.items() if h is None]
            slot = same[0] if same else empty[0] if empty else min(self.SNAPSHOTS, key=lambda s: held[s])  # type: ignore[arg-type, return-value]
        value = f"{step}\n".encode() + payload
        self._store.set(self.key(rank, slot), value)
        if self.mirror is not None:
            self.mirror.copy(self.key(rank, slot), value)
        self._known[(rank, slot)] = step

    def steps(self, rank: int) -> list[int]:
        """The steps whose local state ``rank`` has published (ring slots and snapshot)."""
        found = set()
        for slot in (*range(self.RING), *self.SNAPSHOTS):
            step = self._step_in(rank, slot)
            if step is not None:
                found.add(step)
        return sorted(found)

    def read(self, rank: int, step: int) -> bytes | None:
        """``rank``'s published local state of ``step``, or None."""
        for slot in (step % self.RING, *self.SNAPSHOTS):
            head = self._head(rank, slot)
            if head is not None and head[0] == step:
                return head[1]
        return None

    def read_decoded(self, rank: int, step: int) -> dict[str, Any]:
        payload = self.read(rank, step)
        if payload is None:
            raise RuntimeError(f"rank {rank} has not published its local state of step {step}")
        return decode_local(payload)

    def _step_in(self, rank: int, slot: int | str) -> int | None:
        """The step ``slot`` holds, from what this process knows (the store is asked once per slot)."""
        if (rank, slot) not in self._known:
            head = self._head(rank, slot)
            self._known[(rank, slot)] = head[0] if head is not None else None
        return self._known[(rank, slot)]

    def _head(self, rank: int, slot: int | str) -> tuple[int, bytes] | None:
        key = self.key(rank, slot)
        if not self._store.check([key]):
            return None
        head, payload = self._store.get(key).split(b"\n", 1)
        return int(head), payload


def same_local(a: Any, b: Any) -> bool:
    """Equal local states: the same keys, sequences of the same length (a list and a tuple alike), tensors by
    dtype, shape and value, plain data by type and value."""
    return all(isinstance(p, Pair) and _same_leaf(p.a, p.b) for p in pairs(a, b, sequences_alike=True))


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


def as_peer(sd: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A peer's local state, to compute as that peer: its CUDA RNG stream becomes this device's."""
    theirs = sd.pop("rerun", {}).get("device")  # the machine is mid-flow: its own state stays
    cuda = sd.get("rng", {}).get("cuda")
    if cuda is not None and theirs is not None and device.type == "cuda" and theirs != device.index:
        cuda = list(cuda)
        cuda[device.index] = cuda[theirs]
        sd["rng"]["cuda"] = cuda
    return sd
