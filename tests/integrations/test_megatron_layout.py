"""Megatron's rank layout and the heal-source mapping: pure functions, checked against Megatron's own generator."""

from __future__ import annotations

import itertools

import pytest

from resilient_train.integrations.megatron import ParallelLayout

pytestmark = pytest.mark.timeout(60)


def test_default_order_coordinates():
    # tp fastest, then cp, then dp, then pp (Megatron's tp-cp-ep-dp-pp).
    lay = ParallelLayout(world_size=16, tensor=2, pipeline=2, context=2)
    assert lay.data == 2
    c = lay.coords(13)  # 13 = 1 + 2*0 + 4*1 + 8*1
    assert (c.tp, c.cp, c.dp, c.pp) == (1, 0, 1, 1)
    assert all(lay.rank_of(lay.coords(r)) == r for r in range(16))


def test_replicas_share_tensor_and_pipeline_coordinates():
    lay = ParallelLayout(world_size=8, tensor=2, pipeline=2)  # dp = 2
    assert lay.replicas(0) == [2]
    assert lay.replicas(5) == [7]
    lay_cp = ParallelLayout(world_size=8, tensor=2, context=2)  # cp ranks hold the same weights: dp = 2
    assert lay_cp.replicas(1) == [3, 5, 7]


def test_heal_sources_are_same_shard_and_spread():
    lay = ParallelLayout(world_size=8, tensor=2, pipeline=2)  # TP2 x PP2 x DP2
    lost = [1, 4]
    holders = [r for r in range(8) if r not in lost]
    plan = lay.heal_sources(lost, holders)
    assert plan.uncovered == []
    for target, source in plan.sources.items():
        assert lay.shard_of(target) == lay.shard_of(source) and source in holders
    assert plan.sources == {1: 3, 4: 6}
    # Two targets of one shard with two holders: one each.
    lay4 = ParallelLayout(world_size=8, tensor=2)  # dp = 4
    spread = lay4.heal_sources([0, 2], [4, 6])
    assert sorted(spread.sources.values()) == [4, 6]


def test_a_shard_with_no_holder_is_uncovered():
    lay = ParallelLayout(world_size=4, tensor=2)  # dp = 2: shards (tp0: 0, 2) and (tp1: 1, 3)
    plan = lay.heal_sources([1, 3], [0, 2])
    assert plan.sources == {} and plan.uncovered == [1, 3]


def test_distributed_optimizer_shards_the_replicas():
    # With the distributed optimizer every DP rank holds its own optimizer shard: no replica...
    lay = ParallelLayout(world_size=4, tensor=1, distributed_optimizer=True)
    assert lay.replicas(0) == []
    # ... unless there are several optimizer instances: the same place in another instance is one.
    lay2 = ParallelLayout(world_size=4, distributed_optimizer=True, optimizer_instances=2)
    assert lay2.replicas(0) == [2] and lay2.replicas(1) == [3]


@pytest.mark.parametrize("bad", [
    {"world_size": 6, "tensor": 4}, {"world_size": 0}, {"world_size": 4, "tensor": True},
    {"world_size": 4, "order": "tp-dp-pp"}, {"world_size": 4, "optimizer_instances": 3},
    {"world_size": 4, "expert": 2},
])
def test_bad_layouts_are_refused(bad):
    with pytest.raises(ValueError):
        ParallelLayout(**bad)


SHAPES = [(8, 2, 2, 1), (16, 2, 2, 2), (8, 1, 4, 1), (12, 3, 1, 2), (8, 1, 1, 2), (4, 1, 1, 1)]
ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp-cp-ep"]


@pytest.mark.parametrize("world,tp,pp,cp", SHAPES)
@pytest.mark.parametrize("order", ORDERS)
def test_groups_match_megatrons_rank_generator(world, tp, pp, cp, order):
    ps = pytest.importorskip("megatron.core.parallel_state",
                             reason="megatron-core is not installed (pip install 'resilient-train[megatron]')")
    lay = ParallelLayout(world_size=world, tensor=tp, pipeline=pp, context=cp, order=order)
    gen = ps.RankGenerator(tp=tp, ep=1, dp=lay.data, pp=pp, cp=cp, order=order)
    for kind in ["tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp"]:
        ours = lay.groups(kind)
        theirs = sorted(gen.get_ranks(kind), key=lambda g: min(g))
        assert ours == theirs, kind
        for r in range(world):
            index, size = lay.position(r, kind)
            group = next(g for g in theirs if r in g)
            assert (index, size) == (group.index(r), len(group)), (kind, r)


def test_replicas_are_the_data_parallel_group_members():
    """Without the distributed optimizer a rank's replicas are exactly its dp-cp group (Megatron's view)."""
    for world, tp, pp, cp in SHAPES:
        lay = ParallelLayout(world_size=world, tensor=tp, pipeline=pp, context=cp)
        dpcp = lay.groups("dp-cp")
        for r, group in itertools.product(range(world), dpcp):
            if r in group:
                assert lay.replicas(r) == [x for x in group if x != r]
