"""Joining a generation and agreeing on where it resumes.

Every rank (a survivor or a replacement) publishes what it can restore, counts
itself in, and waits until the whole world has joined, or until the
generation is declared failed (then it moves on to the next). All ranks then
compute the same :class:`ResumePlan` from the same published facts, so no
extra round of agreement is needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch.distributed as dist

from resilient_train.store import Keys, StoreTimeout, current_generation, wait_until

__all__ = ["GenerationFailed", "JoinError", "Membership", "ResumePlan", "ResumeSource", "RunFinished", "join_generation", "plan_resume"]


class JoinError(RuntimeError):
    """The world did not assemble before the deadline."""


class GenerationFailed(RuntimeError):
    """Another party declared the current generation failed."""


class RunFinished(Exception):
    """The run's final state is already committed: nothing is left to do."""


class ResumeSource(str, Enum):
    SNAPSHOT = "snapshot"  # every rank rolls back to a common in-memory snapshot
    DISK = "disk"  # no common snapshot: everyone loads the newest valid checkpoint
    START = "start"  # a fresh run: nothing to restore


@dataclass(frozen=True, kw_only=True)
class Membership:
    """What one rank brings to a generation."""

    rank: int
    pid: int
    snapshot_steps: list[int]  # in-memory snapshots this rank holds
    local_steps: list[int]  # steps whose rank-local state this rank can load (published in the store)
    replacement: bool
    fresh: bool = False  # a rank of a brand-new run (nothing to restore)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, data: bytes | str) -> "Membership":
        return cls(**json.loads(data))


@dataclass(frozen=True, kw_only=True)
class ResumePlan:
    generation: int
    source: ResumeSource
    step: int | None  # the step every rank resumes from (None: from disk, newest valid)
    heal_from: int | None  # the rank whose replicated state replacements copy
    replacements: list[int] = field(default_factory=list)  # ranks without the replicated state
    members: dict[int, Membership] = field(default_factory=dict)


def plan_resume(generation: int, members: dict[int, Membership]) -> ResumePlan:
    """The same pure function on every rank: newest step that everybody can restore."""
    if all(m.fresh for m in members.values()):
        return ResumePlan(generation=generation, source=ResumeSource.START, step=None, heal_from=None, members=members)
    holders = {r: m for r, m in members.items() if m.snapshot_steps}
    replacements = sorted(r for r in members if r not in holders)
    common: set[int] | None = None
    for m in members.values():
        # A holder restores from its own snapshots; a replacement needs its
        # predecessor's published local state (and a holder to heal from).
        have = set(m.snapshot_steps) if m.snapshot_steps else set(m.local_steps)
        common = have if common is None else common & have
    if holders and common:
        step = max(common)
        return ResumePlan(
            generation=generation,
            source=ResumeSource.SNAPSHOT,
            step=step,
            heal_from=min(holders),
            replacements=replacements,
            members=members,
        )
    return ResumePlan(generation=generation, source=ResumeSource.DISK, step=None, heal_from=None, members=members)


def join_generation(
    store: dist.Store,
    *,
    world_size: int,
    me: Membership,
    timeout: float,
    finished: Callable[[], bool] = lambda: False,
) -> ResumePlan:
    """Joins the current generation; moves to the next one each time it fails.

    Raises :class:`RunFinished` when ``finished()`` turns true while waiting
    (the run ended without this rank, which has nothing left to do).
    """
    while True:
        g = current_generation(store)
        store.set(Keys.member(g, me.rank), me.to_json())
        store.add(Keys.joined(g), 1)

        def settled() -> bool:
            return store.add(Keys.joined(g), 0) >= world_size or store.check([Keys.fault(g)]) or finished()

        try:
            wait_until(settled, timeout=timeout, what=f"all {world_size} ranks to join generation {g}")
        except StoreTimeout as e:
            raise JoinError(str(e)) from None
        if finished():
            raise RunFinished()
        if store.check([Keys.fault(g)]):
            continue
        members = {r: Membership.from_json(store.get(Keys.member(g, r))) for r in range(world_size)}
        return plan_resume(g, members)
