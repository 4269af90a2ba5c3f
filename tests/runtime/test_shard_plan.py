"""Sharded state's pieces on their own: replica classes, the resume plan with buddy copies, refusals."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from checkpointing import write_state
from resilient_train.rank.buddy import BUDGET, Interval
from resilient_train.rank.errors import UsageError
from resilient_train.rank.generation import RankMembership, ResumeSource, plan_resume
from resilient_train.rank.mesh import MeshSpec
from resilient_train.rank.shard_state import checksum


def _m(rank, live=None, local=(), *, cls=None, own=(), buddy=None, replacement=False):
    return RankMembership(rank=rank, pid=100 + rank, live_step=live, snapshot_step=None, local_steps=list(local),
                      replacement=replacement, replica_class=rank if cls is None else cls, own_steps=list(own),
                      buddy_steps={str(k): list(v) for k, v in (buddy or {}).items()})


@pytest.mark.timeout(10)
def test_replica_classes_follow_the_mesh():
    fsdp = MeshSpec(shape=(-1,), names=("shard",))
    assert [fsdp.replica_class(r, 4) for r in range(4)] == [0, 1, 2, 3]
    hsdp = MeshSpec(shape=(2, -1), names=("replicate", "shard"), replicate=("replicate",))
    assert [hsdp.replica_class(r, 4) for r in range(4)] == [0, 1, 0, 1]
    tp_dp = MeshSpec(shape=(-1, 2), names=("dp", "tp"), replicate=("dp",))
    assert [tp_dp.replica_class(r, 4) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(UsageError, match="do not divide"):
        MeshSpec(shape=(3, -1), names=("a", "b")).sizes(4)


@pytest.mark.timeout(10)
def test_the_first_replica_of_each_class_writes_its_shards_to_disk():
    assert all(MeshSpec(shape=(-1,), names=("shard",)).first_replica(r, 3) for r in range(3))
    hsdp = MeshSpec(shape=(2, -1), names=("replicate", "shard"), replicate=("replicate",))
    assert [hsdp.first_replica(r, 4) for r in range(4)] == [True, True, False, False]
    tp_dp = MeshSpec(shape=(-1, 2), names=("dp", "tp"), replicate=("dp",))
    assert [tp_dp.first_replica(r, 6) for r in range(6)] == [True, True, False, False, False, False]


@pytest.mark.timeout(10)
def test_a_lost_shard_with_no_replica_heals_from_its_buddy():
    # Pure FSDP on 3 ranks: rank 1 died in step 6; rank 2 holds rank 1's copies of 5 and 6.
    members = {0: _m(0, 6, [5, 6, 7], own=[5, 6], buddy={2: [5, 6]}),
               1: _m(1, None, [5, 6], replacement=True),
               2: _m(2, 6, [5, 6, 7], own=[5, 6], buddy={1: [5, 6]})}
    plan = plan_resume(4, members)
    assert plan.source is ResumeSource.LIVE and plan.step == 6
    assert plan.buddy_from == {1: 2} and plan.heal_from == {} and plan.healed == [1]


@pytest.mark.timeout(10)
def test_survivors_a_step_ahead_roll_back_to_the_buddy_copy():
    # Rank 0 committed step 6 (at 7) and its buddy refresh of 7 failed with rank 1 gone: both at 6.
    members = {0: _m(0, 7, [6, 7], own=[5, 6], buddy={1: [5, 6]}), 1: _m(1, None, [6, 7], replacement=True)}
    plan = plan_resume(2, members)
    assert plan.step == 6 and plan.from_snapshot == [0] and plan.buddy_from == {1: 0}


@pytest.mark.timeout(10)
def test_a_replica_class_heals_from_its_live_member_not_from_a_buddy():
    # HSDP 2x2: classes {0, 2} and {1, 3}; rank 3 lost, rank 1 holds its shard live.
    members = {r: _m(r, 9, [8, 9], cls=r % 2) for r in range(3)}
    members[3] = _m(3, None, [8, 9], cls=1, replacement=True)
    plan = plan_resume(1, members)
    assert plan.step == 9 and plan.heal_from == {3: 1} and plan.buddy_from == {}


@pytest.mark.timeout(10)
def test_a_lost_rank_and_its_buddy_leave_only_the_disk():
    members = {0: _m(0, None, [5, 6], replacement=True), 1: _m(1, None, [5, 6], replacement=True),
               2: _m(2, 6, [5, 6], own=[5, 6], buddy={1: [5, 6]})}
    assert plan_resume(3, members).source is ResumeSource.DISK


@pytest.mark.timeout(10)
def test_checksum_sees_one_flipped_bit():
    t = [torch.arange(1000, dtype=torch.float32), torch.tensor(3.0)]
    before = checksum(t)
    t[0].view(torch.uint8)[17] ^= 0x10
    assert checksum(t) != before


@pytest.mark.timeout(60)
def test_a_dtensor_is_refused_by_the_whole_tensor_writer(tmp_path):
    """The bug of issue 12: rank 0 wrote its shard of each DTensor as if it were the whole tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=20))
    try:
        mesh = init_device_mesh("cpu", (1,))
        dt = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
        with pytest.raises(ValueError, match="DTensor"):
            write_state(tmp_path / "final", {"model": {"w": dt}}, step=1)
        assert not (tmp_path / "final").exists()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(30)
def test_the_buddy_interval_is_chosen_from_the_measured_refresh_and_steps_and_kept_in_the_store(tmp_path):
    """At the sixth boundary: the smallest k with refresh <= BUDGET * k * step, the largest any rank asks
    for (a MAX all-reduce; one gloo rank here), written to the store for later generations."""
    now = [0.0]
    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    try:
        interval = Interval(None, clock=lambda: now[0])
        interval.restart(store)
        refreshed_at = []
        for step in range(1, 9):
            now[0] += 0.100  # every step takes 100 ms
            if interval.due(step):
                refreshed_at.append(step)
                interval.refreshed(0.050 if step == 2 else 9.0)  # the first (warm-up) refresh is not used
            chosen = interval.settle(store, torch.device("cpu"))
            if step == 6:
                assert chosen == 25 == interval.every  # 50 ms <= 0.02 * k * 100 ms: k = 25
        assert BUDGET == 0.02
        assert refreshed_at == [1, 2]  # measuring: the first two boundaries; then every 25 steps
        assert interval.due(25) and not interval.due(26)
        later = Interval(None)
        later.restart(store)  # a later generation, or a replacement: the run's choice
        assert later.every == 25 and later.due(50)
        fixed = Interval(3)
        fixed.restart(store)
        assert fixed.every == 3 and fixed.due(3) and not fixed.due(4)
    finally:
        dist.destroy_process_group()
