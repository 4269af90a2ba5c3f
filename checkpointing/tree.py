"""Nested state <-> flat tensors plus a JSON skeleton.

A state is a tree of dicts, lists and tuples whose leaves are tensors or plain
JSON data (int, float, bool, str, None). Tensors are flattened to dotted keys
(``model.layer.weight``, ``optim.state.0.exp_avg``: the names DCP's own
flattening gives a nested dict), and the tree itself, with plain values inline
and tensors replaced by their keys, becomes a JSON skeleton stored in the
manifest. Nothing is ever pickled.

Skeleton encoding: ``{"T": key}`` tensor, ``{"V": value}`` plain value,
``{"D": [[key, child], ...]}`` dict (keys keep their JSON type: str, int or
bool), ``{"L": [...]}`` list, ``{"U": [...]}`` tuple.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["MAX_DEPTH", "Skeleton", "check_skeleton", "fill_template", "flatten_state", "unflatten_state",
           "skeleton_keys"]

Skeleton = dict[str, Any]
_PLAIN = (int, float, bool, str, type(None))
# Nesting of a state (dicts and lists inside each other). Real states are a few levels deep; the bound
# keeps the recursive readers below far from Python's recursion limit on a forged manifest.
MAX_DEPTH = 64


def flatten_state(state: Any, *, prefix: str = "", dtensors: bool = False) -> tuple[dict[str, torch.Tensor], Skeleton]:
    """Returns ``(flat tensors by dotted key, skeleton)``; raises ``ValueError`` on unsupported leaves.

    A DTensor (one rank's piece of a sharded tensor) is refused unless ``dtensors``: then it is
    returned as it is, for the caller to write as a chunk (:mod:`checkpointing.shards`).
    """
    flat: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Skeleton:
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
        if isinstance(node, dict):
            items = []
            for k, v in node.items():
                if not isinstance(k, (str, int)) or (isinstance(k, str) and not k):
                    raise ValueError(f"checkpoint state at {path!r}: dict keys must be non-empty str or int, got {k!r}")
                items.append([k, walk(v, f"{path}.{k}" if path else str(k))])
            return {"D": items}
        if isinstance(node, (list, tuple)):
            children = [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node)]
            return {"U" if isinstance(node, tuple) else "L": children}
        if isinstance(node, _PLAIN):
            return {"V": node}
        raise ValueError(
            f"checkpoint state at {path!r}: unsupported value of type {type(node).__name__}; "
            "leaves must be tensors or int/float/bool/str/None (nothing is pickled)"
        )

    skeleton = walk(state, prefix)
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


def unflatten_state(skeleton: Skeleton, resolve: Callable[[str], torch.Tensor]) -> Any:
    """Rebuilds the nested state; ``resolve(key)`` supplies each tensor."""
    if "T" in skeleton:
        return resolve(skeleton["T"])
    if "V" in skeleton:
        return skeleton["V"]
    if "D" in skeleton:
        return {k: unflatten_state(child, resolve) for k, child in skeleton["D"]}
    if "L" in skeleton:
        return [unflatten_state(child, resolve) for child in skeleton["L"]]
    if "U" in skeleton:
        return tuple(unflatten_state(child, resolve) for child in skeleton["U"])
    raise ValueError(f"malformed checkpoint skeleton node: {sorted(skeleton)}")


def skeleton_keys(skeleton: Skeleton) -> list[str]:
    """The tensor keys a skeleton refers to, in tree order."""
    keys: list[str] = []

    def walk(node: Skeleton) -> None:
        if "T" in node:
            keys.append(node["T"])
        elif "D" in node:
            for _, child in node["D"]:
                walk(child)
        elif "L" in node or "U" in node:
            for child in node.get("L", node.get("U", [])):
                walk(child)

    walk(skeleton)
    return keys


def fill_template(template: Any, loaded: Any, path: str = "") -> Any:
    """Copies ``loaded`` into ``template``'s tensors in place (shapes and dtypes must match); returns the filled tree."""
    where = path or "<root>"
    if isinstance(template, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"checkpoint load: {where} is {type(loaded).__name__} in the checkpoint, a tensor in the template")
        if loaded.shape != template.shape or loaded.dtype != template.dtype:
            raise ValueError(
                f"checkpoint load: {where} is {loaded.dtype}{list(loaded.shape)} in the checkpoint, "
                f"{template.dtype}{list(template.shape)} in the template"
            )
        with torch.no_grad():
            template.copy_(loaded)
        return template
    if isinstance(template, dict):
        if not isinstance(loaded, dict):
            raise ValueError(f"checkpoint load: {where} is not a dict in the checkpoint")
        missing = [k for k in template if k not in loaded]
        if missing:
            raise ValueError(f"checkpoint load: {where} has no entry {missing[0]!r} in the checkpoint")
        out = dict(loaded)
        for k, v in template.items():
            out[k] = fill_template(v, loaded[k], f"{path}.{k}" if path else str(k))
        return out
    if isinstance(template, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(template) == len(loaded):
        items = [fill_template(t, x, f"{path}.{i}" if path else str(i)) for i, (t, x) in enumerate(zip(template, loaded))]
        return type(template)(items)
    return loaded
