"""The one walker over nested state, and its flattening to tensors plus a JSON skeleton.

A state is a tree whose branches are dicts, lists and tuples (subclasses
count: an ``OrderedDict`` is a dict, a namedtuple a tuple) and whose leaves are
everything else: tensors, plain values, objects. Every walk of such a tree in
this project goes through :func:`children` (what a branch holds, in its order:
a dict's entries as inserted, a list's or tuple's items) and the walks built on
it here: :func:`leaves` (lazily, depth first), :func:`fold` (bottom up, with a
path), :func:`map_leaves` (the same tree, each leaf replaced) and :func:`pairs`
(two trees side by side; :func:`fill_template` folds two trees walked as
one). The order is part of the contract: host snapshots,
healing and checkpoints number tensors by it, and bitwise comparisons pair them
by it. torch's ``_pytree`` is not used: it walks by an exact-type registry any
imported library can extend (a dict subclass it does not know is a leaf, with
its tensors inside), rebuilds namedtuples and defaultdicts that neither a
``weights_only`` header nor a JSON skeleton can carry, and takes ``None`` for a
branch.

Flattening for checkpoints: tensors are flattened to dotted keys
(``model.layer.weight``, ``optim.state.0.exp_avg``: the names DCP's own
flattening gives a nested dict), and the tree itself, with plain values inline
and tensors replaced by their keys, becomes a JSON skeleton stored in the
manifest. Nothing is ever pickled.

Skeleton encoding: ``{"T": key}`` tensor, ``{"V": value}`` plain value,
``{"D": [[key, child], ...]}`` dict (keys keep their JSON type: str, int or
bool), ``{"L": [...]}`` list, ``{"U": [...]}`` tuple.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

__all__ = ["MAX_DEPTH", "Gap", "GapKind", "KeyPath", "Pair", "Skeleton", "check_skeleton", "children", "fill_template",
           "flatten_state", "fold", "leaves", "map_leaves", "pairs", "skeleton_keys", "unflatten_state"]

Skeleton = dict[str, Any]
KeyPath = tuple[Any, ...]  # the keys and indices from the root to a node
Children = Callable[[Any], "list[tuple[Any, Any]] | None"]
_PLAIN = (int, float, bool, str, type(None))
# Nesting of a state (dicts and lists inside each other). Real states are a few levels deep; the bound
# keeps the recursive readers below far from Python's recursion limit on a forged manifest.
MAX_DEPTH = 64


def children(node: Any) -> list[tuple[Any, Any]] | None:
    """A branch's children as ``(key, child)``: a dict's entries in insertion order, a list's or tuple's items
    with their indices; ``None`` for a leaf."""
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    return None


def leaves(tree: Any, *, children: Children = children) -> Iterator[Any]:
    """The leaves of ``tree`` in tree order (depth first, each branch's children in order), lazily: a caller
    that stops early walks no further. ``children``: another tree language (a skeleton, a fingerprint's view
    of a call)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        kids = children(node)
        if kids is None:
            yield node
        else:
            todo.extend(child for _, child in reversed(kids))


def _extend(path: KeyPath, key: Any) -> KeyPath:
    return (*path, key)


def fold(tree: Any, leaf: Callable[[Any, Any], Any], branch: Callable[[Any, list[tuple[Any, Any]], Any], Any], *,
         path: Any = (), join: Callable[[Any, Any], Any] = _extend, children: Children = children) -> Any:
    """Bottom up: ``leaf(node, path)`` for each leaf, ``branch(node, [(key, result), ...], path)`` for each branch
    once its children are done, in tree order. A child's path is ``join(path, key)``, called just before the
    child is walked (the place for a check of the key)."""

    def walk(node: Any, at: Any) -> Any:
        kids = children(node)
        if kids is None:
            return leaf(node, at)
        return branch(node, [(k, walk(child, join(at, k))) for k, child in kids], at)

    return walk(tree, path)


def _no_path(path: None, key: Any) -> None:
    return None


def map_leaves(fn: Callable[[Any], Any], tree: Any, *, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """The same tree with each leaf replaced by ``fn(leaf)`` (called in tree order); branches are rebuilt as
    plain dicts, lists and tuples. ``is_leaf``: a node taken whole although it is a branch."""

    # The branches of children(), tested inline: host copies and heals map whole optimizer states, and a
    # call per node through fold doubled their time.
    def walk(node: Any) -> Any:
        if is_leaf is not None and is_leaf(node):
            return fn(node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        return fn(node)

    return walk(tree)


class GapKind(str, enum.Enum):
    ONLY_A = "only_a"  # a dict key only the first tree has
    ONLY_B = "only_b"  # a dict key only the second tree has
    KIND = "kind"  # a list against a tuple (or two other sequence types)
    LENGTH = "length"  # two sequences of different lengths


@dataclass(frozen=True)
class Pair:
    """Two leaves at one place (or a leaf against a branch: what stands there differs)."""

    path: KeyPath
    a: Any
    b: Any


@dataclass(frozen=True)
class Gap:
    """A place where the two trees' shapes differ (nothing below it is paired)."""

    path: KeyPath
    kind: GapKind
    a: Any
    b: Any


def pairs(a: Any, b: Any, *, sequences_alike: bool = False, path: KeyPath = ()) -> Iterator[Pair | Gap]:
    """Two trees side by side, lazily, in the first one's order. Two dicts: the keys only one has (the first's,
    then the second's), then the common keys. Two sequences: paired item by item when their lengths (and, unless
    ``sequences_alike``, their types) agree. Anything else is a :class:`Pair`."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if k not in b:
                yield Gap((*path, k), GapKind.ONLY_A, a[k], None)
        for k in b:
            if k not in a:
                yield Gap((*path, k), GapKind.ONLY_B, None, b[k])
        for k in a:
            if k in b:
                yield from pairs(a[k], b[k], sequences_alike=sequences_alike, path=(*path, k))
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) and not sequences_alike:
            yield Gap(path, GapKind.KIND, a, b)
        elif len(a) != len(b):
            yield Gap(path, GapKind.LENGTH, a, b)
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                yield from pairs(x, y, sequences_alike=sequences_alike, path=(*path, i))
    else:
        yield Pair(path, a, b)


def flatten_state(state: Any, *, prefix: str = "", dtensors: bool = False) -> tuple[dict[str, torch.Tensor], Skeleton]:
    """Returns ``(flat tensors by dotted key, skeleton)``; raises ``ValueError`` on unsupported leaves.

    A DTensor (one rank's piece of a sharded tensor) is refused unless ``dtensors``: then it is
    returned as it is, for the caller to write as a chunk (:mod:`checkpointing.shards`).
    """
    flat: dict[str, torch.Tensor] = {}

    def leaf(node: Any, path: str) -> Skeleton:
        if isinstance(node, torch.Tensor):
            if not dtensors and _is_dtensor(node):
                raise ValueError(
                    f"checkpoint state at {path!r}: a DTensor (one rank's shard of a sharded tensor) cannot be "
                    "written whole by one rank; gather it first (DCP get_state_dict with full_state_dict=True)")
            if not _is_dtensor(node) and (node.is_sparse or node.layout != torch.strided):
                raise ValueError(f"checkpoint state at {path!r}: only dense (strided) tensors are supported")
            if path in flat:
                raise ValueError(f"checkpoint state: two entries flatten to the same key {path!r}")
            if not path:
                raise ValueError("checkpoint state: a bare tensor needs to sit inside a dict")
            flat[path] = node.detach()
            return {"T": path}
        if isinstance(node, _PLAIN):
            return {"V": node}
        raise ValueError(
            f"checkpoint state at {path!r}: unsupported value of type {type(node).__name__}; "
            "leaves must be tensors or int/float/bool/str/None (nothing is pickled)"
        )

    def branch(node: Any, items: list[tuple[Any, Skeleton]], path: str) -> Skeleton:
        if isinstance(node, dict):
            return {"D": [[k, child] for k, child in items]}
        return {"U" if isinstance(node, tuple) else "L": [child for _, child in items]}

    def join(path: str, key: Any) -> str:  # a list's index passes the dict keys' check
        if not isinstance(key, (str, int)) or (isinstance(key, str) and not key):
            raise ValueError(f"checkpoint state at {path!r}: dict keys must be non-empty str or int, got {key!r}")
        return f"{path}.{key}" if path else str(key)

    skeleton = fold(state, leaf, branch, path=prefix, join=join)
    check_skeleton(skeleton)  # what is written must read back: the same depth bound
    return flat, skeleton


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return False
    return isinstance(t, DTensor)


def check_skeleton(skeleton: Any, where: str = "tree") -> None:
    """Raises ``ValueError`` unless ``skeleton`` is a well-formed skeleton at most :data:`MAX_DEPTH` deep.

    Iterative, so a forged manifest nested 100,000 deep is refused without recursing.
    """
    todo: list[tuple[Any, int]] = [(skeleton, 0)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError(f"{where}: a skeleton node must be a one-entry object, got {_kind(node)}")
        (tag, body), = node.items()
        if tag == "T":
            if not isinstance(body, str) or not body:
                raise ValueError(f"{where}: a tensor key must be a non-empty string")
        elif tag == "V":
            if not isinstance(body, _PLAIN):
                raise ValueError(f"{where}: a plain value must be a number, string, bool or null, got {_kind(body)}")
        elif tag == "D":
            if not isinstance(body, list):
                raise ValueError(f"{where}: a dict node must hold a list of [key, child] pairs")
            for item in body:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))):
                    raise ValueError(f"{where}: a dict entry must be [str or int key, child]")
                todo.append((item[1], depth + 1))
        elif tag in ("L", "U"):
            if not isinstance(body, list):
                raise ValueError(f"{where}: a list node must hold a list")
            todo.extend((child, depth + 1) for child in body)
        else:
            raise ValueError(f"{where}: unknown skeleton node {tag!r}")


def _kind(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _skeleton_children(node: Skeleton) -> list[Any] | None:
    """A skeleton as a tree (for :func:`fold` and :func:`leaves`): tensor and plain nodes are its leaves."""
    if "T" in node or "V" in node:
        return None
    if "D" in node:
        return node["D"]
    if "L" in node:
        return list(enumerate(node["L"]))
    if "U" in node:
        return list(enumerate(node["U"]))
    return None


def unflatten_state(skeleton: Skeleton, resolve: Callable[[str], torch.Tensor]) -> Any:
    """Rebuilds the nested state; ``resolve(key)`` supplies each tensor."""

    def leaf(node: Skeleton, _: None) -> Any:
        if "T" in node:
            return resolve(node["T"])
        if "V" in node:
            return node["V"]
        raise ValueError(f"malformed checkpoint skeleton node: {sorted(node)}")

    def branch(node: Skeleton, items: list[tuple[Any, Any]], _: None) -> Any:
        if "D" in node:
            return dict(items)
        values = [v for _, v in items]
        return values if "L" in node else tuple(values)

    return fold(skeleton, leaf, branch, path=None, join=_no_path, children=_skeleton_children)


def skeleton_keys(skeleton: Skeleton) -> list[str]:
    """The tensor keys a skeleton refers to, in tree order."""
    return [node["T"] for node in leaves(skeleton, children=_skeleton_children) if "T" in node]


def fill_template(template: Any, loaded: Any, path: str = "") -> Any:
    """Copies ``loaded`` into ``template``'s tensors in place (shapes and dtypes must match); returns the filled tree.

    The two trees are walked as one, whose nodes are ``(template, loaded, path)``: a template's dict opens on
    a dict of the checkpoint holding all its keys (anything else is refused), a template's list or tuple on a
    sequence of the checkpoint as long; elsewhere the checkpoint's value stands.
    """

    def opened(node: tuple[Any, Any, str]) -> list[tuple[Any, Any]] | None:
        t, x, at = node
        if isinstance(t, dict):
            where = at or "<root>"
            if not isinstance(x, dict):
                raise ValueError(f"checkpoint load: {where} is not a dict in the checkpoint")
            missing = [k for k in t if k not in x]
            if missing:
                raise ValueError(f"checkpoint load: {where} has no entry {missing[0]!r} in the checkpoint")
            return [(k, (v, x[k], f"{at}.{k}" if at else str(k))) for k, v in t.items()]
        if isinstance(t, (list, tuple)) and isinstance(x, (list, tuple)) and len(t) == len(x):
            return [(i, (a, b, f"{at}.{i}" if at else str(i))) for i, (a, b) in enumerate(zip(t, x))]
        return None

    def leaf(node: tuple[Any, Any, str], _: None) -> Any:
        t, x, at = node
        if not isinstance(t, torch.Tensor):
            return x
        where = at or "<root>"
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"checkpoint load: {where} is {type(x).__name__} in the checkpoint, a tensor in the template")
        if x.shape != t.shape or x.dtype != t.dtype:
            raise ValueError(
                f"checkpoint load: {where} is {x.dtype}{list(x.shape)} in the checkpoint, "
                f"{t.dtype}{list(t.shape)} in the template"
            )
        with torch.no_grad():
            t.copy_(x)
        return t

    def branch(node: tuple[Any, Any, str], items: list[tuple[Any, Any]], _: None) -> Any:
        t, x, _ = node
        if isinstance(t, dict):
            out = dict(x)  # the checkpoint's entries the template does not name stay
            out.update(items)
            return out
        return type(t)([v for _, v in items])

    return fold((template, loaded, path), leaf, branch, path=None, join=_no_path, children=opened)
