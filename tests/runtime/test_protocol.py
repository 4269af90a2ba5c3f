"""The pieces of the recovery protocol, each on its own."""

from __future__ import annotations

import pytest
import torch

from resilient_train.generation import Membership, ResumeSource, plan_resume
from resilient_train.lifecycle import IllegalTransition, Lifecycle, SupervisorState
from resilient_train.snapshot import SnapshotRing


def _m(rank, snaps=(), local=(), replacement=False, fresh=False):
    return Membership(rank=rank, pid=100 + rank, snapshot_steps=list(snaps), local_steps=list(local),
                      replacement=replacement, fresh=fresh)


@pytest.mark.timeout(10)
def test_plan_resumes_from_newest_common_step():
    # Rank 0 finished step 6, rank 1 did not; rank 2 is a replacement whose
    # predecessor published steps 5 and 6.
    plan = plan_resume(3, {0: _m(0, [5, 6]), 1: _m(1, [4, 5]), 2: _m(2, local=[5, 6], replacement=True)})
    assert plan.source is ResumeSource.SNAPSHOT
    assert (plan.step, plan.heal_from, plan.replacements) == (5, 0, [2])


@pytest.mark.timeout(10)
def test_plan_rolls_back_further_when_the_dead_rank_lacks_the_newest_local_state():
    plan = plan_resume(1, {0: _m(0, [5, 6]), 1: _m(1, local=[4, 5], replacement=True)})
    assert plan.step == 5


@pytest.mark.timeout(10)
def test_plan_falls_back_to_disk_without_a_common_step():
    assert plan_resume(1, {0: _m(0, local=[3]), 1: _m(1, local=[3])}).source is ResumeSource.DISK
    assert plan_resume(1, {0: _m(0, [7, 8]), 1: _m(1, local=[3, 4])}).source is ResumeSource.DISK


@pytest.mark.timeout(10)
def test_plan_fresh_run():
    assert plan_resume(0, {0: _m(0, fresh=True), 1: _m(1, fresh=True)}).source is ResumeSource.START


@pytest.mark.timeout(10)
def test_snapshot_ring_keeps_two_steps_and_reuses_buffers():
    ring = SnapshotRing(2)
    w = torch.arange(4.0)
    ring.capture(1, {"w": w}, b"one")
    first_buffer = ring.get(1).buffers[0]
    w.add_(1)
    ring.capture(2, {"w": w}, b"two")
    w.add_(1)
    ring.capture(3, {"w": w}, b"three")  # overwrites step 1's slot, in place
    assert ring.steps() == [2, 3]
    assert ring.get(3).buffers[0] is first_buffer
    restored = ring.get(2).replicated()["w"]
    assert torch.equal(restored, torch.arange(4.0) + 1)
    restored.add_(100)  # a restored copy must not alias the snapshot
    assert torch.equal(ring.get(2).replicated()["w"], torch.arange(4.0) + 1)
    ring.drop_after(2)
    assert ring.steps() == [2]


@pytest.mark.timeout(10)
def test_lifecycle_rejects_illegal_moves():
    life = Lifecycle()
    life.to(SupervisorState.JOINING)
    with pytest.raises(IllegalTransition):
        life.to(SupervisorState.FINISHING)
    life.to(SupervisorState.RESTORING)
    life.to(SupervisorState.TRAINING)
    life.to(SupervisorState.RECOVERING)
    life.to(SupervisorState.JOINING)
