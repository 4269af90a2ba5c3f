"""The one walker over nested state (checkpointing.tree): its order, its branches, its laziness, two trees side by side.

The order is what host snapshots, heals and checkpoints number tensors by, so
the tests pin it, and pin that the users of the walker agree on it.
"""

from __future__ import annotations

import collections

import pytest
import torch

from checkpointing.tree import (Gap, GapKind, Pair, children, fill_template, flatten_state, fold, leaves, map_leaves,
                                pairs, skeleton_keys, unflatten_state)
from resilient_train.rank.local_state import same_local
from resilient_train.rank.snapshot import TensorRef, flatten, unflatten

Point = collections.namedtuple("Point", "x y")


def _state() -> dict:
    t = [torch.full((2,), float(i)) for i in range(6)]
    return {"z": t[0], "a": [t[1], (t[2], 7, None)], 3: {"k": t[3], "s": "text"},
            "o": collections.OrderedDict(b=t[4], a=t[5])}


@pytest.mark.timeout(30)
def test_leaves_come_depth_first_in_insertion_order_not_sorted() -> None:
    got = list(leaves(_state()))
    tensors = [x for x in got if isinstance(x, torch.Tensor)]
    assert [int(x[0]) for x in tensors] == [0, 1, 2, 3, 4, 5]
    assert [x for x in got if not isinstance(x, torch.Tensor)] == [7, None, "text"]


@pytest.mark.timeout(30)
def test_subclasses_are_branches_and_everything_else_a_leaf() -> None:
    assert children(collections.OrderedDict(b=1, a=2)) == [("b", 1), ("a", 2)]
    assert children(Point(1, 2)) == [(0, 1), (1, 2)]
    assert children(torch.Size([3, 4])) == [(0, 3), (1, 4)]  # a tuple, as every walker here has taken it
    for leaf in (torch.zeros(2), None, "ab", b"ab", 3, {1, 2}, object()):
        assert children(leaf) is None


@pytest.mark.timeout(30)
def test_leaves_is_lazy() -> None:
    asked: list[object] = []

    def counting(node: object) -> list | None:
        asked.append(node)
        return children(node)

    tree = [[1, 2], [3, [4, 5]], [6]]
    it = leaves(tree, children=counting)
    assert next(it) == 1
    assert asked == [tree, [1, 2], 1]  # nothing past the first leaf was looked at
    assert list(it) == [2, 3, 4, 5, 6]


@pytest.mark.timeout(30)
def test_map_leaves_rebuilds_plain_containers_in_order() -> None:
    seen: list[object] = []
    out = map_leaves(lambda x: seen.append(x) or (x * 10 if isinstance(x, int) else x),
                     collections.OrderedDict(b=[1, (2, 3)], a=Point(4, 5)))
    assert seen == [1, 2, 3, 4, 5]
    assert out == {"b": [10, (20, 30)], "a": (40, 50)}
    assert type(out) is dict and type(out["a"]) is tuple  # no OrderedDict, no namedtuple: plain data travels
    assert map_leaves(lambda x: "ref", {"a": {"__x": 1}, "b": {"c": 2}}, is_leaf=lambda n: n == {"__x": 1}) == \
        {"a": "ref", "b": {"c": "ref"}}


@pytest.mark.timeout(30)
def test_fold_joins_a_key_before_it_walks_the_child() -> None:
    events: list[str] = []

    def join(path: str, key: object) -> str:
        events.append(f"join {key}")
        return f"{path}/{key}"

    def leaf(node: object, path: str) -> str:
        events.append(f"leaf {path}")
        return path

    result = fold({"a": [1, 2], "b": 3}, leaf, lambda node, items, path: dict(items), path="", join=join)
    assert result == {"a": {0: "/a/0", 1: "/a/1"}, "b": "/b"}
    assert events == ["join a", "join 0", "leaf /a/0", "join 1", "leaf /a/1", "join b", "leaf /b"]


@pytest.mark.timeout(30)
def test_snapshot_heal_and_checkpoint_number_tensors_in_the_same_order() -> None:
    state = _state()
    state[3]["n"] = torch.zeros(1)  # a dict key that sorts before others: the order stays insertion order
    skeleton, tensors = flatten(state)
    flat, tree = flatten_state({"s": {str(k): v for k, v in state.items()}})
    assert [t for t in tensors] == [t for t in leaves(state) if isinstance(t, torch.Tensor)]
    assert all(a is b.detach() or torch.equal(a, b) for a, b in zip(tensors, flat.values()))
    assert skeleton_keys(tree) == list(flat)
    assert skeleton["a"][1][0] == TensorRef(2)
    back = unflatten(skeleton, tensors)
    assert same_local(back, state)
    assert same_local(unflatten_state(tree, flat.__getitem__)["s"], {str(k): v for k, v in state.items()})


@pytest.mark.timeout(30)
def test_pairs_reports_what_differs_in_the_first_trees_order() -> None:
    a = {"x": 1, "y": [1, 2], "z": (1,), "w": {"q": 1}}
    b = {"w": {"q": 2}, "v": 0, "y": [1, 2, 3], "z": [1], "x": 1}
    got = list(pairs(a, b))
    assert got == [Gap(("v",), GapKind.ONLY_B, None, 0), Pair(("x",), 1, 1),
                   Gap(("y",), GapKind.LENGTH, [1, 2], [1, 2, 3]), Gap(("z",), GapKind.KIND, (1,), [1]),
                   Pair(("w", "q"), 1, 2)]
    assert list(pairs((1,), [2], sequences_alike=True)) == [Pair((0,), 1, 2)]
    assert list(pairs({"a": 1}, [1])) == [Pair((), {"a": 1}, [1])]  # a dict against a list: unlike at the root


@pytest.mark.timeout(30)
def test_same_local_is_strict_on_dtype_and_type_and_alike_on_sequences() -> None:
    t = torch.arange(3)
    assert same_local({"a": [t, 1]}, {"a": (t.clone(), 1)})
    assert not same_local({"a": t}, {"a": t.to(torch.int32)})
    assert not same_local({"a": 1}, {"a": 1.0})
    assert not same_local({"a": 1}, {"a": 1, "b": 2})
    assert same_local({"a": 1, "b": 2}, {"b": 2, "a": 1})  # key order is not content


@pytest.mark.timeout(30)
def test_fill_template_fills_in_place_and_keeps_the_checkpoints_other_values() -> None:
    live = {"model": {"w": torch.zeros(2)}, "optim": {"lr": 0.1, "hist": [torch.zeros(1)]}}
    w = live["model"]["w"]
    loaded = {"model": {"w": torch.ones(2)}, "optim": {"lr": 0.5, "hist": [torch.ones(1), torch.ones(1)]},
              "local": {"step": 3}}
    out = fill_template(live, loaded)
    assert out["model"]["w"] is w and torch.equal(w, torch.ones(2))  # the template's own tensor, filled
    assert out["optim"]["lr"] == 0.5 and len(out["optim"]["hist"]) == 2  # the checkpoint's values stand
    assert out["local"] == {"step": 3}  # and its entries the template does not name
    with pytest.raises(ValueError, match=r"model has no entry 'b' in the checkpoint"):
        fill_template({"model": {"w": w, "b": torch.zeros(1)}}, loaded)
    with pytest.raises(ValueError, match=r"model.w is torch.float32\[2\] in the checkpoint, torch.float32\[3\]"):
        fill_template({"model": {"w": torch.zeros(3)}}, loaded)
