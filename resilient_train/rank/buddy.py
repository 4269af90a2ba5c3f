"""Buddy copies: the redundancy of a shard nobody else holds (pure FSDP, pure TP).

Every ``every`` steps, at a step boundary, each rank copies its own shard into
host memory and sends it to its **holder**, the next rank in a ring; it keeps
the copy its **owner** (the previous rank) sent. The sender's CRC-32 travels
with the copy and is checked before the copy is ever offered for healing: a
copy whose bytes changed in host memory is never loaded (Megatron-LM #5281: a
corrupt local copy rebuilt from a replica gave NaN three steps later).

The newest two refreshes are kept, of both kinds: a rank can die in the middle
of a refresh, leaving some holders with the new copy and some without, and the
plan (:mod:`resilient_train.rank.generation`) then resumes from the older one, which
every rank still holds of itself. Memory: four shards of host memory per rank.

Nothing leaves the ring while one exchange is in flight: even ranks send first,
odd ranks receive first, so a ring of any size completes.

**How often** (``every=None``, the default: :class:`Interval`). A refresh
copies and sends the whole shard at a step boundary, on the step's path: every
step it costs a fixed share of the step (measured: 27% of a 214 ms FSDP step
for a 9.5 MiB shard on 4 CPU ranks). So the job measures itself once: the
first refreshes of the run and the steps around them; the interval is the
smallest k for which a refresh costs at most ``BUDGET`` of k steps, the largest
any rank asks for (one 1-element all-reduce), printed once and kept in the store
for later generations and replacements. What that costs at recovery: a rank
lost with the only live copy of its shard is rebuilt from its buddy's copy of
the last refresh, so every rank goes back to that boundary and redoes up to
k - 1 completed steps (and the interrupted one). Nothing is lost but that time:
the boundary's data position and RNG states are kept with the copy, the redone
steps give the same bits, and the run ends bitwise equal to a fault-free one.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from monitors.events import EventLog
from resilient_train.rank.heal import receive_state, send_state
from resilient_train.rank.parts import Part
from resilient_train.rank.shard_state import checksum
from resilient_train.rank.snapshot import flatten, unflatten
from resilient_train.rank.train_state import TrainState

__all__ = ["BUDGET", "BuddyCopies", "HostCopy", "Interval"]

KEEP = 2
BUDGET = 0.02  # an automatic interval keeps the refreshes under this share of the step time
_EVERY_KEY = "rt/buddy/every"  # the run's interval, once chosen (read by later generations and replacements)
_WARM, _MEASURED, _DECIDE = 1, 2, 6  # boundaries of the measuring generation: refreshes at the first two


class Interval:
    """The refresh interval: given, or chosen from the job's first steps (``every=None``).

    Until it is chosen, a generation refreshes at its first two boundaries (the
    second one timed) and times the steps between its boundaries (without the
    refreshes); at its sixth boundary every rank proposes the smallest k with
    ``refresh <= BUDGET * k * step`` and the largest proposal wins.
    """

    def __init__(self, every: int | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self._clock = clock
        self.chosen: dict[str, float] | None = None  # what the choice was made from
        self._auto = every is None
        self._boundaries = 0
        self._refresh_s: float | None = None
        self._steps: list[float] = []
        self._left: float | None = None  # when the last boundary's own work ended

    def restart(self, store: Any) -> None:
        """A generation starts: take the run's interval if one was chosen, else measure in this generation."""
        if self._auto:
            value = store.get(_EVERY_KEY).decode() if store.check([_EVERY_KEY]) else ""
            self.every = int(value) if value else None  # a choice that did not reach the store is made again
        self._boundaries, self._refresh_s, self._steps, self._left = 0, None, [], None

    def due(self, step: int) -> bool:
        self._boundaries += 1
        if self._left is not None:
            self._steps.append(self._clock() - self._left)
        if self.every is not None:
            return step % self.every == 0
        return self._boundaries in (_WARM, _MEASURED)

    def refreshed(self, seconds: float) -> None:
        if self.every is None and self._boundaries == _MEASURED:
            self._refresh_s = seconds

    def settle(self, store: Any, device: torch.device) -> int | None:
        """At the end of a boundary's work: the interval chosen now (a collective), or None."""
        chosen = None
        if self.every is None and self._boundaries == _DECIDE and self._refresh_s is not None:
            step_s = statistics.median(self._steps[1:] or self._steps)
            mine = max(1, math.ceil(self._refresh_s / (BUDGET * max(step_s, 1e-9)) - 1e-9))
            votes = torch.tensor([float(mine)], device=device)
            dist.all_reduce(votes, op=dist.ReduceOp.MAX)
            chosen = self.every = int(votes.item())
            store.set(_EVERY_KEY, str(chosen))  # every rank: the same value, whoever lives to write it
            self.chosen = {"every": chosen, "refresh_s": self._refresh_s, "step_s": step_s, "proposed": mine}
        self._left = self._clock()
        return chosen


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
    def __init__(self, *, every: int | None, rank: int, world_size: int, payload: Callable[[], dict[str, Any]],
                 publish_local: Callable[[int], None], device: torch.device, events: EventLog,
                 corrupt_at: tuple[int, int] | None = None) -> None:
        self.interval = Interval(every)
        self.rank, self.world_size = rank, world_size
        self.holder, self.owner = (rank + 1) % world_size, (rank - 1) % world_size
        self._payload, self._publish_local, self._device, self._events = payload, publish_local, device, events
        self.own: list[HostCopy] = []
        self.theirs: list[HostCopy] = []
        self._corrupt_at = corrupt_at  # (holder rank, step): a test flips a byte of the copy it received then
        self._reported_generation = -1
        self.generation = -1

    @property
    def every(self) -> int | None:
        """The refresh interval in steps (None while it is being measured)."""
        return self.interval.every

    def on_generation(self, generation: int, store: Any) -> None:
        self.generation = generation
        self._store = store
        self.interval.restart(store)

    def on_step_end(self, state: TrainState) -> None:
        if self.interval.due(state.step):
            t0 = time.monotonic()
            self.refresh(state.step)
            self.interval.refreshed(time.monotonic() - t0)
        chosen = self.interval.settle(self._store, self._device)
        if chosen is not None:
            info = self.interval.chosen or {}
            self._events.emit("buddy_interval", rank=self.rank, step=state.step, budget=BUDGET, **info)
            if self.rank == 0:
                print(f"resilient-train: buddy copies every {chosen} steps (a refresh took "
                      f"{info['refresh_s'] * 1e3:.0f} ms, a step {info['step_s'] * 1e3:.0f} ms: at most "
                      f"{BUDGET:.0%} of the step time); a rank lost with the only copy of its shard redoes up to "
                      f"{chosen - 1} steps (SupervisorConfig.buddy_every sets it)", file=sys.stderr, flush=True)

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
