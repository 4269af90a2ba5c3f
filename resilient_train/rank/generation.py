"""Joining a generation and agreeing on where it resumes.

Every rank (a survivor or a replacement) publishes what it holds (a ``set``:
the store sends no reply). The planner (rank 0) waits for every membership,
reads them in one request, computes the :class:`ResumePlan` and settles the
generation with it; every other rank reads the generation's outcome with one
``get`` the store answers when it is written: two calls per rank and O(N)
requests for the whole world, where every rank reading every other rank's
membership was O(N^2). A generation declared failed before its plan settles
as FAILED (:func:`resilient_train.protocol.store.fail_join`, which also ends the
planner's wait): whichever comes first holds for every rank, and the ranks
move on to the next generation.

What a rank holds after a fault (see docs/design.md, "Recovery from live
replicas"): its *live* state is exactly the boundary it last reached, unless
the fault struck while the optimizer was changing it (then it holds none);
and it can restore the rank-local state of the steps it published. The plan
takes the newest step that some rank holds live (or in a host snapshot) and
whose local state every rank can restore; everyone else heals from a holder.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from enum import Enum
from typing import Any, Callable, Iterator

import torch.distributed as dist

from resilient_train.protocol.members import members_of
from resilient_train.rank.elastic.width import Width, assign
from resilient_train.rank.errors import GenerationFailed
from resilient_train.rank.local_state import LocalSlots
from resilient_train.protocol.store import Keys, StoreTimeout, current_generation, read_fault, settle, wait_until

__all__ = [
    "GenerationFailed", "JoinError", "RankMembership", "ResumePlan", "ResumeSource", "RunFinished",
    "join_generation", "plan_resume",
]


class JoinError(RuntimeError):
    """The world did not assemble before the deadline."""


class RunFinished(Exception):
    """The run's final state is already committed: nothing is left to do."""


class ResumeSource(str, Enum):
    LIVE = "live"  # the newest step a replica holds: the others heal from it
    DISK = "disk"  # no replica of a recoverable step: everyone loads the newest valid checkpoint
    START = "start"  # a fresh run: nothing to restore (a checkpoint, if any, is loaded)


@dataclass(frozen=True, kw_only=True)
class RankMembership:
    """What one rank brings to a generation."""

    rank: int
    pid: int
    live_step: int | None  # the boundary its model and optimizer are at; None: unknown (a replacement, a torn update)
    snapshot_step: int | None  # a host snapshot it holds (SupervisorConfig.snapshot_every)
    local_steps: list[int]  # steps whose rank-local state it can restore (published in the store)
    replacement: bool
    fresh: bool = False  # a rank of a brand-new run (nothing to restore)
    new_process: bool = False  # this process has not been part of a generation yet (a replacement just started)
    # Ranks of one replica class hold the same shards (every rank, for data parallelism; resilient_train.rank.mesh).
    replica_class: int = 0
    own_steps: list[int] = field(default_factory=list)  # host copies of its own shard (buddy refreshes)
    buddy_steps: dict[str, list[int]] = field(default_factory=dict)  # owner rank -> verified copies it holds
    # An elastic job (resilient_train.rank.elastic): the logical ranks it computed in its last generation, and the
    # steps whose local state each of them has published.
    hosted: list[int] = field(default_factory=list)
    logical_steps: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(vars(self))  # its fields are plain JSON already (asdict's deep copy is half the join's CPU)

    @classmethod
    def from_json(cls, data: bytes | str) -> "RankMembership":
        return cls(**json.loads(data))

    def own(self) -> set[int]:
        """Boundaries this rank can restore by itself, without a peer."""
        steps = set(self.own_steps)
        if self.snapshot_step is not None:
            steps.add(self.snapshot_step)
        return steps


@dataclass(frozen=True, kw_only=True)
class ResumePlan:
    generation: int
    source: ResumeSource
    step: int | None  # the step every rank resumes from (None: from disk, newest valid)
    # target rank -> the rank it copies its state from, a live holder of the same shards (others keep their own)
    heal_from: dict[int, int] = field(default_factory=dict)
    from_snapshot: list[int] = field(default_factory=list)  # ranks that restore their own host copy
    # target rank -> the rank holding the target's buddy copy of ``step`` (a shard with no live replica)
    buddy_from: dict[int, int] = field(default_factory=dict)
    # Ranks whose process joined for the first time in this generation, replacing a lost one.
    replacements: list[int] = field(default_factory=list)
    # The fault that ended the generation before (its first report), read once by the planner: a rank woken
    # by it joined without reading it.
    cause: dict[str, Any] | None = None
    # An elastic job: the generation's members and who computes each logical rank (Width.to_json); None: every
    # rank a member, computing its own.
    width: dict[str, list[int]] | None = None

    @property
    def healed(self) -> list[int]:
        return sorted({*self.heal_from, *self.buddy_from})

    def to_json(self) -> str:
        """What every rank reads: O(ranks that heal), not O(world) (the memberships stay with the planner)."""
        return json.dumps({"generation": self.generation, "source": self.source.value, "step": self.step,
                           "heal_from": sorted(self.heal_from.items()), "from_snapshot": self.from_snapshot,
                           "buddy_from": sorted(self.buddy_from.items()), "replacements": self.replacements,
                           "cause": self.cause, "width": self.width})

    @classmethod
    def from_json(cls, data: bytes | str) -> "ResumePlan":
        d = json.loads(data)
        return cls(generation=int(d["generation"]), source=ResumeSource(d["source"]), step=d["step"],
                   heal_from={int(t): int(f) for t, f in d["heal_from"]}, from_snapshot=list(d["from_snapshot"]),
                   buddy_from={int(t): int(h) for t, h in d["buddy_from"]}, replacements=list(d["replacements"]),
                   cause=d.get("cause"), width=d.get("width"))


def _replacements(members: dict[int, RankMembership]) -> list[int]:
    return sorted(r for r, m in members.items() if m.replacement and m.new_process)


def _classes(members: dict[int, RankMembership]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r, m in sorted(members.items()):
        out.setdefault(m.replica_class, []).append(r)
    return out


def _buddy_holder(members: dict[int, RankMembership], owner: int, step: int) -> int | None:
    holders = sorted(r for r, m in members.items() if r != owner and step in m.buddy_steps.get(str(owner), []))
    return holders[0] if holders else None


def _covered(members: dict[int, RankMembership], ranks: list[int], step: int) -> bool:
    """A replica class can be rebuilt at ``step``: a member holds it (live or its own copy), or a buddy each."""
    if any(members[r].live_step == step or step in members[r].own() for r in ranks):
        return True
    return all(_buddy_holder(members, r, step) is not None for r in ranks)


def plan_resume(generation: int, members: dict[int, RankMembership],
                logical_steps: dict[int, list[int]] | None = None) -> ResumePlan:
    """The same pure function on every rank: the newest step that can be rebuilt everywhere.

    Every replica class (ranks holding the same shards) must be rebuildable at
    that step, and every rank's local state of it must be in the store (an
    elastic job: every logical rank's, ``logical_steps``). Within
    a class: ranks at the step keep their state, ranks with their own host copy
    of it restore that, the others copy from a live member (spread over them);
    a class with no member at the step is rebuilt from buddy copies.
    """
    if all(m.fresh for m in members.values()):
        return ResumePlan(generation=generation, source=ResumeSource.START, step=None,
                          replacements=_replacements(members))
    classes = _classes(members)
    steps = {s for m in members.values() for s in (m.live_step, *m.own()) if s is not None}
    steps |= {s for m in members.values() for held in m.buddy_steps.values() for s in held}
    def local_held(s: int) -> bool:
        if logical_steps is not None:
            return all(s in held for held in logical_steps.values())
        return all(s in m.local_steps for m in members.values())

    candidates = [s for s in steps if local_held(s) and all(_covered(members, ranks, s) for ranks in classes.values())]
    if not candidates:
        return ResumePlan(generation=generation, source=ResumeSource.DISK, step=None,
                          replacements=_replacements(members))
    step = max(candidates)
    heal_from: dict[int, int] = {}
    buddy_from: dict[int, int] = {}
    from_snapshot: list[int] = []
    for ranks in classes.values():
        sources = [r for r in ranks if members[r].live_step == step]
        restoring = [r for r in ranks if members[r].live_step != step and step in members[r].own()]
        from_snapshot += restoring
        if not sources:
            sources = restoring  # they restore their own copy first, then serve it
        keep = {*sources, *restoring}
        targets = [r for r in ranks if r not in keep]
        for i, t in enumerate(targets):
            if sources:
                # Spread the targets over the sources: each source sends to about the same number of ranks.
                heal_from[t] = sources[i % len(sources)]
            else:
                holder = _buddy_holder(members, t, step)
                assert holder is not None, (t, step)
                buddy_from[t] = holder
    return ResumePlan(generation=generation, source=ResumeSource.LIVE, step=step, heal_from=heal_from,
                      from_snapshot=sorted(from_snapshot), buddy_from=buddy_from,
                      replacements=_replacements(members))


def join_generation(
    store: dist.Store,
    *,
    world_size: int,
    me: Callable[[], RankMembership],
    timeout: float,
    finished: Callable[[], bool] = lambda: False,
    stopped: Callable[[], None] = lambda: None,
    generation: int | None = None,
    elastic: bool = False,
) -> ResumePlan:
    """Joins the current generation; moves to the next one each time it fails.

    ``generation``: the one to try first without reading the store's (a
    woken rank's: the one after the generation it watched).

    ``me()`` is called once per generation tried (what a rank holds does not
    change while it waits, but it is read fresh). Raises :class:`RunFinished`
    when ``finished()`` turns true while waiting (the run ended without this
    rank); ``stopped()`` raises when the job was stopped. Both are looked at
    when the generation settles as FAILED: whoever finishes or stops the run
    settles the generation being joined so (``interrupt_generation``).

    ``elastic``: the generation's members are those its key names
    (resilient_train.protocol.members), not every rank, and its plan says who
    computes each logical rank.
    """
    deadline = time.monotonic() + timeout
    while True:
        g = generation if generation is not None else current_generation(store)
        generation = None
        member = me()
        store.set(Keys.member(g, member.rank), member.to_json())  # a set has no reply: nothing to wait for
        # An elastic generation's planner is its lowest member (slot 0's node may be gone: resilient_train.rank.elastic).
        if member.rank == (min(members_of(store, g, world_size)) if elastic else PLANNER):
            _plan(store, g, world_size, deadline, elastic=elastic)
        settled = _outcome(store, g, deadline)
        if settled is None:
            stopped()
            if finished():
                raise RunFinished() from None
            raise JoinError(f"timed out after {timeout:.1f} s waiting for all {world_size} ranks to join "
                            f"generation {g}") from None
        if settled.decode() != Keys.FAILED:
            # Every rank joined: the run cannot have finished without them, and a stop from now on
            # interrupts this generation, which its watcher sees.
            plan = ResumePlan.from_json(settled)
            if plan.width is not None and member.rank not in plan.width["members"]:
                raise JoinError(f"rank {member.rank} is not a member of generation {g} (its node was declared lost)")
            return plan
        stopped()
        if finished():
            raise RunFinished()
        try:  # the fault moves the generation before it settles this one; a stop does not move it (stopped() raised)
            wait_until(lambda: current_generation(store) > g, timeout=max(deadline - time.monotonic(), 0.001),
                       what=f"generation {g} to be left")
        except StoreTimeout as e:
            raise JoinError(str(e)) from None


PLANNER = 0  # the rank that plans every generation: it waits for every membership, the others for the plan


def _plan(store: dist.Store, g: int, world_size: int, deadline: float, *, elastic: bool = False) -> None:
    """Every membership of ``g`` (one wait, one read), the plan, written once (unless ``g`` already failed).

    A generation that fails first ends the wait too: :func:`resilient_train.protocol.store.fail_join` fills the
    memberships still missing with FAILED, and the plan is not made. ``elastic``: the members are the
    slots ``g``'s key names, and the plan assigns the logical ranks (resilient_train.rank.elastic).
    """
    slots = members_of(store, g, world_size) if elastic else list(range(world_size))
    keys = [Keys.member(g, r) for r in slots]
    try:
        with _until(store, deadline):
            values = store.multi_get(keys)  # the store answers once every key is set
    except dist.DistStoreError:
        return  # the deadline: the plan's reader times out with everyone else
    if any(v == _FAILED_BYTES for v in values):
        return  # the generation failed while it assembled: its outcome is FAILED
    with _collector_paused():  # thousands of fresh dicts would start a full collection of the rank's heap
        members = {r: RankMembership(**d) for r, d in zip(slots, json.loads(b"[" + b",".join(values) + b"]"))}
        if elastic:
            plan = _elastic_plan(store, g, world_size, members)
        else:
            plan = plan_resume(g, members)
    if g > 0:
        plan = replace(plan, cause=read_fault(store, g - 1))
    settle(store, g, plan.to_json())


def _elastic_plan(store: dist.Store, g: int, width: int, members: dict[int, RankMembership]) -> ResumePlan:
    """The plan of an elastic generation: every logical rank's local state must be held (a member reports
    its own logical ranks'; the store is asked of the others, whose host is gone), and the logical ranks are
    assigned to the members (balanced, stable, home first)."""
    logical: dict[int, list[int]] = {}
    for m in members.values():
        for x, steps in m.logical_steps.items():
            logical[int(x)] = steps
    slots = LocalSlots(store)
    for x in range(width):
        if x not in logical:
            logical[x] = slots.steps(x)
    plan = plan_resume(g, members, logical_steps=logical)
    hosts = assign(width, sorted(members), {r: m.hosted for r, m in members.items()})
    return replace(plan, width=Width(tuple(sorted(members)), tuple(hosts)).to_json())


_FAILED_BYTES = Keys.FAILED.encode()


def _outcome(store: dist.Store, g: int, deadline: float) -> bytes | None:
    """``g``'s outcome (its plan, or FAILED) once it is written, in one call; None past the deadline."""
    try:
        with _until(store, deadline):
            return store.get(Keys.outcome(g))  # the store answers when the key is set
    except dist.DistStoreError:
        return None


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No garbage collection inside: what is made here holds no cycles, and a training process's heap is large
    (a full collection set off by 4,096 memberships took 0.15 s in the planner, in bench/coordination.py)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _until(store: dist.Store, deadline: float) -> Iterator[None]:
    """The connection's blocking reads (``get``, ``multi_get``: they wait for their keys) end at ``deadline``."""
    previous = store.timeout
    store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    try:
        yield
    finally:
        store.set_timeout(previous)
