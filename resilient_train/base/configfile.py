"""Reading the files users hand the runtime (monitor configs, chaos scenarios), and checking their values.

A config file is plain data and nothing more: YAML (JSON is a subset) read by
a safe loader that also refuses anchors and aliases, since a 446-byte file of
nested aliases expands to gigabytes ("billion laughs"), and a key given twice
in one mapping (YAML would keep the last silently); at most
:data:`MAX_CONFIG_BYTES` and :data:`MAX_NESTING` levels. Every mistake is a
``ValueError`` whose one-line message names the file and the field, so the
command line can print it and exit 2 before any worker starts.

The ``require_*`` helpers are what configuration dataclasses call in
``__post_init__``: the right type (a bool is not a number), a finite value, a
range, so a ``NaN`` timeout or ``port: 99999`` never gets past the parser.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any, Iterable

import yaml

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_COUNT",
    "MAX_NESTING",
    "MAX_SECONDS",
    "check_fields",
    "kind",
    "load_config_file",
    "require_bool",
    "require_int",
    "require_number",
    "require_str",
    "require_strs",
]

MAX_CONFIG_BYTES = 1 << 20  # real configs and scenarios are a few KiB; this bounds what a crafted one costs
MAX_NESTING = 32  # real ones are 4 deep; the YAML composer recurses once per level
# Bounds on what a file may set: a week is past any timeout or interval a job means (and inside what
# time.sleep and Event.wait take: 1e308 s overflows them); a billion is past any count of steps or polls.
MAX_SECONDS = 7 * 24 * 3600.0
MAX_COUNT = 10**9


class _PlainLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without anchors, aliases or deep nesting."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(
                None, None, "anchors and aliases (&name, *name) are not allowed", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_NESTING} levels", event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A key given twice is refused: YAML keeps the last one silently, so a setting the author believes
        in would be dropped (YAML 1.2 requires keys to be unique)."""
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: the constructor says so itself
                    continue
                if earlier is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice (first on line {earlier.line + 1})",
                        key_node.start_mark)
        return super().construct_mapping(node, deep)


def load_config_file(path: str | os.PathLike[str], what: str) -> Any:
    """The plain data in a YAML or JSON file; ``ValueError`` naming ``what`` and the file otherwise."""
    p = Path(path)
    label = f"{what} {str(p)!r}"
    try:
        st = os.stat(p)
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{label} is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{label} is not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{label} has {st.st_size} bytes; at most {MAX_CONFIG_BYTES} are read")
        with open(p, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"{label} does not exist") from None
    except OSError as e:
        raise ValueError(f"{label} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{label} is not UTF-8 text (byte {e.start})") from None
    try:
        return yaml.load(text, Loader=_PlainLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ValueError(f"{label}: not valid YAML: {_yaml_problem(e)}") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else str(problem)


def kind(value: Any) -> str:
    """A value's type as the file's author would call it."""
    if value is None:
        return "null"
    return {dict: "a mapping", list: "a list", tuple: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__)


def check_fields(data: Any, known: Iterable[str], where: str) -> dict[str, Any]:
    """``data`` as a mapping with string keys, all of them in ``known``."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {kind(data)}")
    names = set(known)
    unknown = sorted(repr(k) if not isinstance(k, str) else k for k in data if k not in names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected some of {sorted(names)}")
    return data


def require_number(
    value: Any, name: str, *, low: float | None = None, high: float | None = None, above: float | None = None,
) -> float:
    """A finite int or float (not a bool) with ``low <= value <= high`` and ``value > above``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {kind(value)}")
    if isinstance(value, float) and not math.isfinite(value):  # an int is finite, however large
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if above is not None and not value > above:
        raise ValueError(f"{name} must be > {above:g}, got {_show(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low:g}, {high:g}]" if low is not None and high is not None else (
            f">= {low:g}" if low is not None else f"<= {high:g}")
        raise ValueError(f"{name} must be {bounds}, got {_show(value)}")
    return value


def _show(value: float) -> str:
    """A number for a one-line message: a 4,000-digit integer is shown by its size."""
    text = repr(value)
    return text if len(text) <= 24 else f"an integer of {len(text.lstrip('-'))} digits"


def require_int(value: Any, name: str, *, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {kind(value)}")
    require_number(value, name, low=low, high=high)
    return value


def require_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {kind(value)}")
    return value


def require_str(value: Any, name: str, *, allow_none: bool = False, max_len: int = 4096) -> str | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {kind(value)}")
    if len(value) > max_len or "\0" in value:
        raise ValueError(f"{name}: not a usable string (longer than {max_len} or holding a NUL)")
    return value


def require_strs(value: Any, name: str, *, choices: Iterable[str] | None = None) -> tuple[str, ...]:
    """A list (or tuple) of strings, each one of ``choices`` when given."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of strings, got {kind(value)}")
    allowed = set(choices) if choices is not None else None
    for item in value:
        require_str(item, f"{name} entry")
        if allowed is not None and item not in allowed:
            raise ValueError(f"{name}: unknown entry {item!r}; expected some of {sorted(allowed)}")
    return tuple(value)
