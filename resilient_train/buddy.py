"""Buddy copies: the redundancy of a shard nobody else holds (pure FSDP, pure TP).

Every ``every`` steps, at a step boundary, each rank copies its own shard into
host memory and sends it to its **holder**, the next rank in a ring; it keeps
the copy its **owner** (the previous rank) sent. The sender's CRC-32 travels
with the copy and is checked before the copy is ever offered for healing: a
copy whose bytes changed in host memory is never loaded (Megatron-LM #5281: a
corrupt local copy rebuilt from a replica gave NaN three steps later).

The newest two refreshes are kept, of both kinds: a rank can die in the middle
of a refresh, leaving some holders with the new copy and some without, and the
plan (:mod:`resilient_train.generation`) then resumes from the older one, which
every rank still holds of itself. Memory: four shards of host memory per rank.

Nothing leaves the ring while one exchange is in flight: even ranks send first,
odd ranks receive first, so a ring of any size completes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from monitors.events import EventLog
from resilient_train.heal import receive_state, send_state
from resilient_train.parts import Part
from resilient_train.shard_state import checksum
from resilient_train.snapshot import flatten, unflatten
from resilient_train.train_state import TrainState

__all__ = ["BuddyCopies", "HostCopy"]

KEEP = 2


@dataclass(kw_only=True)
class HostCopy:
    """One rank's shard at one step boundary, in host memory, with its sender's checksum."""

    owner: int
    step: int
    skeleton: Any
    tensors: list[torch.Tensor]
    crc: int

    @classmethod
    def of(cls, owner: int, step: int, state: dict[str, Any]) -> "HostCopy":
        skeleton, tensors = flatten(state)
        host = [t.detach().to("cpu", copy=True) for t in tensors]
        return cls(owner=owner, step=step, skeleton=skeleton, tensors=host, crc=checksum(host))

    def state(self) -> dict[str, Any]:
        return unflatten(self.skeleton, self.tensors)

    def verified(self) -> bool:
        return checksum(self.tensors) == self.crc

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class BuddyCopies(Part):
    def __init__(self, *, every: int, rank: int, world_size: int, payload: Callable[[], dict[str, Any]],
                 publish_local: Callable[[int], None], device: torch.device, events: EventLog,
                 corrupt_at: tuple[int, int] | None = None) -> None:
        self.every, self.rank, self.world_size = every, rank, world_size
        self.holder, self.owner = (rank + 1) % world_size, (rank - 1) % world_size
        self._payload, self._publish_local, self._device, self._events = payload, publish_local, device, events
        self.own: list[HostCopy] = []
        self.theirs: list[HostCopy] = []
        self._corrupt_at = corrupt_at  # (holder rank, step): a test flips a byte of the copy it received then
        self._reported_generation = -1
        self.generation = -1

    def on_generation(self, generation: int, store: Any) -> None:
        self.generation = generation

    def on_step_end(self, state: TrainState) -> None:
        if state.step % self.every == 0:
            self.refresh(state.step)

    def refresh(self, step: int) -> None:
        """Copies this rank's shard of boundary ``step`` and swaps copies with the ring's neighbours."""
        t0 = time.monotonic()
        self._publish_local(step)  # the boundary's local state outlives the two ring slots
        mine = HostCopy.of(self.rank, step, self._payload())
        wire = {"crc": mine.crc, "state": mine.state()}
        if self.rank % 2 == 0:
            sent = send_state(wire, self.holder, device=self._device)
            got, received = receive_state(self.owner, device=self._device)
        else:
            got, received = receive_state(self.owner, device=self._device)
            sent = send_state(wire, self.holder, device=self._device)
        skeleton, tensors = flatten(got["state"])
        theirs = HostCopy(owner=self.owner, step=step, skeleton=skeleton, tensors=tensors, crc=int(got["crc"]))
        if self._corrupt_at == (self.rank, step) and tensors:
            big = max(tensors, key=lambda t: t.numel())
            big.view(-1).view(torch.uint8)[0] ^= 0x01  # one flipped bit after the checksum was taken
            self._corrupt_at = None
        self.own = _push(self.own, mine)
        self.theirs = _push(self.theirs, theirs)
        if self._reported_generation != self.generation:
            self._reported_generation = self.generation
            self._events.emit("buddy_refresh", rank=self.rank, step=step, holder=self.holder, bytes_sent=sent,
                              bytes_received=received, seconds=round(time.monotonic() - t0, 6), every=self.every)

    # -------------------------------------------------------------- recovery
    def own_steps(self) -> list[int]:
        return sorted(c.step for c in self.own)

    def offered(self) -> dict[str, list[int]]:
        """The owner's copies this rank can serve: only those whose checksum verifies (checked now)."""
        good = []
        for c in self.theirs:
            if c.verified():
                good.append(c.step)
            else:
                self._events.emit("buddy_copy_corrupt", rank=self.rank, owner=c.owner, step=c.step,
                                  generation=self.generation)
        self.theirs = [c for c in self.theirs if c.step in good]
        return {str(self.owner): sorted(good)} if good else {}

    def own_copy(self, step: int) -> HostCopy:
        copy = next(c for c in self.own if c.step == step)
        if not copy.verified():
            raise RuntimeError(f"rank {self.rank}: its own host copy of step {step} fails its checksum")
        return copy

    def copy_of(self, owner: int, step: int) -> HostCopy:
        return next(c for c in self.theirs if c.owner == owner and c.step == step)

    def resumed(self, step: int) -> None:
        """The job resumes from ``step``: copies of later boundaries belong to steps that are redone."""
        self.own = [c for c in self.own if c.step <= step]
        self.theirs = [c for c in self.theirs if c.step <= step]

    def forget_theirs(self) -> None:
        """A new process holds no copy of anyone."""
        self.theirs = []


def _push(copies: list[HostCopy], new: HostCopy) -> list[HostCopy]:
    kept = [c for c in copies if c.step != new.step]
    return [*kept, new][-KEEP:]
