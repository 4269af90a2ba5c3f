"""The pieces of the recovery protocol, each on its own."""

from __future__ import annotations

import pytest
import torch

from resilient_train.rank.errors import FailureKind, GenerationFailed, UsageError, classify
from resilient_train.rank.generation import RankMembership, ResumeSource, plan_resume
from resilient_train.base.transitions import IllegalTransition
from resilient_train.rank.lifecycle import Lifecycle, SupervisorState
from resilient_train.rank.snapshot import HostSnapshot


def _m(rank, live=None, local=(), snap=None, replacement=False, fresh=False):
    return RankMembership(rank=rank, pid=100 + rank, live_step=live, snapshot_step=snap, local_steps=list(local),
                      replacement=replacement, fresh=fresh)


@pytest.mark.timeout(10)
def test_fault_before_the_commit_resumes_every_survivor_where_it_stands():
    # Rank 2 died in step 6 before the reduction completed: nobody committed 7.
    plan = plan_resume(3, {0: _m(0, 6, [5, 6, 7]), 1: _m(1, 6, [5, 6, 7]), 2: _m(2, None, [5, 6], replacement=True)})
    assert plan.source is ResumeSource.LIVE
    assert plan.step == 6
    assert plan.heal_from == {2: 0}


@pytest.mark.timeout(10)
def test_fault_after_a_commit_moves_everyone_to_the_newest_boundary():
    # Rank 0 committed step 6 (now at 7); rank 1's reduction failed (still at 6); rank 2 died after voting.
    plan = plan_resume(3, {0: _m(0, 7, [6, 7]), 1: _m(1, 6, [6, 7]), 2: _m(2, None, [6, 7], replacement=True)})
    assert plan.step == 7
    assert plan.heal_from == {1: 0, 2: 0}


@pytest.mark.timeout(10)
def test_targets_are_spread_over_the_holders():
    members = {r: _m(r, 9, [8, 9]) for r in range(4)}
    members.update({r: _m(r, None, [8, 9], replacement=True) for r in (4, 5, 6, 7)})
    plan = plan_resume(1, members)
    assert plan.heal_from == {4: 0, 5: 1, 6: 2, 7: 3}


@pytest.mark.timeout(10)
def test_a_step_whose_local_state_is_missing_somewhere_is_not_a_candidate():
    # Rank 0 holds 7 live but rank 1's replacement has only its predecessor's step 6: resume at 6 from the snapshot.
    plan = plan_resume(1, {0: _m(0, 7, [6, 7], snap=6), 1: _m(1, None, [5, 6], replacement=True)})
    assert plan.step == 6 and plan.from_snapshot == [0] and plan.heal_from == {1: 0}


@pytest.mark.timeout(10)
def test_no_replica_falls_back_to_disk():
    assert plan_resume(1, {0: _m(0, None, [3]), 1: _m(1, None, [3])}).source is ResumeSource.DISK
    assert plan_resume(1, {0: _m(0, 8, [8]), 1: _m(1, None, [3, 4])}).source is ResumeSource.DISK


@pytest.mark.timeout(10)
def test_plan_fresh_run():
    assert plan_resume(0, {0: _m(0, fresh=True), 1: _m(1, fresh=True)}).source is ResumeSource.START


@pytest.mark.timeout(10)
def test_membership_round_trips_through_json():
    m = _m(3, 7, [6, 7], snap=5, replacement=True)
    assert RankMembership.from_json(m.to_json()) == m


@pytest.mark.timeout(10)
def test_host_snapshot_reuses_its_buffers_and_hands_out_copies():
    snap = HostSnapshot()
    w = torch.arange(4.0)
    snap.capture(1, {"w": w}, b"one")
    first_buffer = snap.buffers[0]
    w.add_(1)
    snap.capture(2, {"w": w}, b"two")
    assert snap.step == 2 and snap.buffers[0] is first_buffer
    restored = snap.replicated()["w"]
    assert torch.equal(restored, torch.arange(4.0) + 1)
    restored.add_(100)  # a restored copy must not alias the snapshot
    assert torch.equal(snap.replicated()["w"], torch.arange(4.0) + 1)


@pytest.mark.timeout(10)
def test_failures_are_classified():
    def raised(exc):
        try:
            raise exc
        except BaseException as e:  # noqa: BLE001
            return classify(e)

    assert raised(GenerationFailed("moved")).kind is FailureKind.FAULT
    assert raised(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:29067")).kind is FailureKind.FAULT
    assert raised(UsageError("misuse")).kind is FailureKind.USAGE
    assert raised(KeyError("tokens")).kind is FailureKind.EXCEPTION
    assert raised(RuntimeError("shape mismatch in restore_weights")).kind is FailureKind.EXCEPTION
    # The same error at another port or pid has the same signature; another message does not.
    a, b = raised(KeyError("x at 1234")), raised(KeyError("x at 999"))
    assert a.signature.split(" @ ")[0] == b.signature.split(" @ ")[0]
    assert raised(KeyError("y")).signature != a.signature


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


@pytest.mark.timeout(10)
def test_exit_codes_agree_with_the_packages_that_define_them():
    from checkpointing import EXIT_DISK_FULL
    from resilient_train.base import exitcodes
    from resilient_train.rank.rerun import EXIT_RERUN_ELSEWHERE, EXIT_VALIDATION_FAILED

    assert exitcodes.DISK_FULL == EXIT_DISK_FULL
    assert (exitcodes.RERUN_ELSEWHERE, exitcodes.VALIDATION_FAILED) == (EXIT_RERUN_ELSEWHERE, EXIT_VALIDATION_FAILED)
