"""The layout-independent reduction (resilient_train.rank.elastic.ordered): W logical contributions averaged in
logical order give the same bits on any number of processes and any assignment; a plain all-reduce does not.
Real gloo groups, one process per group rank."""

from __future__ import annotations

import pytest
import torch

from jobs import free_port
from ordered_workers import contribution, ordered_run

from resilient_train.rank.elastic.ordered import OrderedSum
from resilient_train.rank.elastic.width import Width, assign

N = 10007  # not a multiple of any group size: the chunks differ by one element


def _expected(width: int) -> torch.Tensor:
    acc = contribution(0, N).clone()
    for x in range(1, width):
        acc.add_(contribution(x, N))
    return acc.div_(width)


@pytest.mark.timeout(300)
def test_the_ordered_average_has_the_same_bits_on_every_layout() -> None:
    layouts = [[[0], [1], [2], [3]], [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1], [2]], [[0, 1, 2, 3]]]
    want = _expected(4)
    for hosted in layouts:
        results = ordered_run(free_port(), hosted, N)
        for rank, got in enumerate(results):
            assert torch.equal(got, want), (hosted, rank, (got - want).abs().max())


@pytest.mark.timeout(60)
def test_a_plain_sum_in_another_order_has_other_bits() -> None:
    """The test above could not fail if the order did not show: it does."""
    a, b, c = (contribution(x, N) for x in range(3))
    assert not torch.equal((a + b) + c, a + (b + c))


@pytest.mark.timeout(60)
def test_the_chunks_and_the_packing() -> None:
    layout = OrderedSum([[0, 2], [1]], me=0)
    assert layout.bounds(5) == [(0, 2), (2, 5)]
    contributions = {0: torch.arange(5.0), 2: torch.arange(5.0) + 20}
    send, ins, outs = layout.pack(contributions, 5)
    assert send.tolist() == [0, 1, 20, 21, 2, 3, 4, 22, 23, 24] and ins == [4, 6] and outs == [4, 2]


@pytest.mark.timeout(60)
def test_logical_ranks_are_assigned_balanced_stable_and_home_first() -> None:
    assert assign(4, [0, 1, 2, 3]) == [0, 1, 2, 3]
    shrunk = assign(4, [0, 1], {0: [0], 1: [1]})  # node 1 (slots 2, 3) lost
    assert shrunk == [0, 1, 0, 1]
    grown = assign(4, [0, 1, 2, 3], {0: [0, 2], 1: [1, 3]})  # it comes back: its ranks take their own back
    assert grown == [0, 1, 2, 3]
    odd = assign(5, [0, 3], {0: [0], 3: [3]})
    assert sorted(odd.count(m) for m in (0, 3)) == [2, 3] and odd[0] == 0 and odd[3] == 3
    w = Width((0, 1), tuple(shrunk))
    assert w.hosted(0) == [0, 2] and w.by_group_rank() == [[0, 2], [1, 3]] and not w.identity
    assert Width.full(4).identity
    with pytest.raises(ValueError):
        assign(4, [])
