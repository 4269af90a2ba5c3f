"""The ring of published local states (resilient_train/rank/local_state.py) survives a split commit.

The case (seen in a whole-suite run, node 0's agent stopped while its rank trained on): the vote's reduction of
step c - 1 completed everywhere; the survivors learned of a failure right after it and gave the step up (still at
boundary c - 1, having published c), while the rank that was then lost committed it and started step c,
publishing c + 1. The survivors resume at c - 1, so the lost rank's replacement needs its predecessor's local
state of c - 1: a ring of two slots had overwritten it with c + 1. Real TCPStore, real encoded states.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from resilient_train.rank.generation import RankMembership, ResumeSource, plan_resume
from resilient_train.rank.local_state import LocalSlots, decode_local, encode_local


def _state(rank: int, step: int) -> bytes:
    return encode_local({"step": step, "rank": rank, "rng": torch.full((4,), float(step))})


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


@pytest.mark.timeout(30)
def test_the_lost_ranks_boundary_before_its_last_commit_is_still_there_and_the_survivors_resume_from_it(store):
    c = 418
    survivors, lost = (1, 2), 0
    writer = LocalSlots(store)
    for step in range(c - 3, c + 2):  # the lost rank: committed up to c, published c + 1 in step c
        writer.publish(lost, step, _state(lost, step))
    for r in survivors:  # the survivors: at c - 1, having published c before their vote on step c - 1
        for step in range(c - 3, c + 1):
            writer.publish(r, step, _state(r, step))

    replacement = LocalSlots(store)  # the replacement's own view, from the store
    held = replacement.steps(lost)
    assert {c - 1, c, c + 1} <= set(held), held
    members = {r: RankMembership(rank=r, pid=10 + r, live_step=c - 1, snapshot_step=None,
                                 local_steps=LocalSlots(store).steps(r), replacement=False) for r in survivors}
    members[lost] = RankMembership(rank=lost, pid=99, live_step=None, snapshot_step=None, local_steps=held,
                                   replacement=True)
    plan = plan_resume(5, members)
    assert plan.source is ResumeSource.LIVE and plan.step == c - 1, plan
    assert plan.heal_from == {lost: survivors[0]}
    restored = decode_local(replacement.read(lost, c - 1))
    assert restored["step"] == c - 1 and torch.equal(restored["rng"], torch.full((4,), float(c - 1)))


@pytest.mark.timeout(30)
def test_a_ring_keeps_exactly_its_last_boundaries(store):
    slots = LocalSlots(store)
    for step in range(10):
        slots.publish(3, step, _state(3, step))
    fresh = LocalSlots(store)
    assert fresh.steps(3) == list(range(10 - LocalSlots.RING, 10))
    assert fresh.read(3, 10 - LocalSlots.RING - 1) is None
    assert decode_local(fresh.read(3, 9))["step"] == 9
