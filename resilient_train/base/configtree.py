"""Config dataclasses as a tree of plain data: built from a file or flags, dumped back, renamed fields.

One walker for every configuration dataclass of the four packages, driven by
the fields' type hints (``resilient_train.runconfig`` composes the root):

* :func:`build` makes a dataclass from plain data (a YAML mapping): unknown
  keys, wrong types, non-finite numbers and durations (``*_s``) out of
  ``[0, MAX_SECONDS]`` are a one-line ``ValueError`` naming the dotted key;
  the class's own ``__post_init__`` then checks its ranges;
* :func:`to_plain` is the inverse (what ``yaml.safe_dump`` writes);
* :func:`parse_text` reads one ``--key=value`` flag's text as that field's type;
* :func:`renamed` keeps a field's old name working for one release (a
  ``DeprecationWarning``, once per name and process);
* :data:`RT_RUN_CONFIG` names the run config file the agent hands its ranks
  (:mod:`resilient_train.base.runfile` reads it, when a script asks: no class here reads it).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import yaml

from resilient_train.base.configfile import (
    MAX_CONFIG_BYTES, MAX_COUNT, MAX_SECONDS, _PlainLoader, kind, require_bool, require_int, require_number,
    require_str,
)

__all__ = ["RT_RUN_CONFIG", "RunConfigVariableError", "build", "build_kwargs", "convert", "dataclass_in", "field_default",
           "hints", "leaf_keys", "parse_text", "renamed", "set_key", "to_plain", "type_at", "type_name"]

RT_RUN_CONFIG = "RT_RUN_CONFIG"  # the run config file (YAML) the agent wrote for its ranks (resilient_train.base.runfile)


class RunConfigVariableError(ValueError):
    """The file ``RT_RUN_CONFIG`` names cannot be read as a run config: one line naming the variable and the
    file, never prefixed with a section's name."""


T = TypeVar("T")
_NONE = type(None)
_WARNED: set[tuple[str, str]] = set()  # (class, old name): each deprecated name warns once per process


# ----------------------------------------------------------------- types
def hints(cls: type) -> dict[str, Any]:
    """The init fields of dataclass ``cls`` and their resolved types, in declaration order."""
    resolved = typing.get_type_hints(cls)
    return {f.name: resolved[f.name] for f in dataclasses.fields(cls) if f.init}


def _parts(tp: Any) -> tuple[Any, bool]:
    """(the type without ``None``, whether ``None`` is allowed); a union of several stays a union."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not _NONE]
        optional = len(args) < len(typing.get_args(tp))
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), optional
    return tp, False


def dataclass_in(tp: Any) -> type | None:
    base, _ = _parts(tp)
    return base if isinstance(base, type) and dataclasses.is_dataclass(base) else None


def type_at(root: type, key: str) -> Any:
    """The type of the dotted ``key`` under dataclass ``root`` (``KeyError`` naming it if there is none)."""
    tp: Any = root
    for i, name in enumerate(key.split(".")):
        cls = dataclass_in(tp)
        if cls is None or name not in (h := hints(cls)):
            raise KeyError(".".join(key.split(".")[: i + 1]))
        tp = h[name]
    return tp


def leaf_keys(root: type, *, skip: Iterable[str] = (), prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Every settable key under ``root``: (dotted key, type, default); nested dataclasses are walked."""
    skip = set(skip)
    out: list[tuple[str, Any, Any]] = []
    defaults = {f.name: field_default(f) for f in dataclasses.fields(root)}
    for name, tp in hints(root).items():
        key = f"{prefix}{name}"
        if key in skip:
            continue
        sub = dataclass_in(tp)
        if sub is not None:
            out.extend(leaf_keys(sub, skip=skip, prefix=f"{key}."))
        else:
            out.append((key, tp, defaults[name]))
    return out


def field_default(f: dataclasses.Field) -> Any:
    """The field's own default (``MISSING`` for a required field)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def type_name(tp: Any) -> str:
    """A type as the README's table shows it: ``float | null``, ``list[str]``, ``one of: a, b``."""
    base, optional = _parts(tp)
    if typing.get_origin(base) in (typing.Union, types.UnionType):
        args = typing.get_args(base)
        if str in args and any(isinstance(a, type) and issubclass(a, enum.Enum) and issubclass(a, str) for a in args):
            args = tuple(a for a in args if a is not str)  # AsyncMode | str: a str is read as the enum
        text = " | ".join(type_name(a) for a in args)
    elif isinstance(base, type) and issubclass(base, enum.Enum):
        text = "one of: " + ", ".join(dict.fromkeys(str(m.value) for m in base.__members__.values()))
    elif typing.get_origin(base) in (tuple, list, frozenset, set):
        text = f"list[{type_name(typing.get_args(base)[0])}]"
    elif typing.get_origin(base) is dict:
        k, v = typing.get_args(base)
        text = f"map[{type_name(k)}: {type_name(v)}]"
    elif base is os.PathLike or typing.get_origin(base) is os.PathLike or base is Path:
        text = "path"
    elif base is Any:
        text = "any"
    else:
        text = getattr(base, "__name__", str(base))
    return f"{text} | null" if optional else text


# -------------------------------------------------------------- building
def convert(tp: Any, value: Any, key: str) -> Any:
    """``value`` (plain data) as type ``tp``; ``ValueError`` naming ``key`` otherwise."""
    base, optional = _parts(tp)
    if value is None:
        if optional or base is Any:
            return None
        raise ValueError(f"{key} must not be null")
    if base is Any:
        return value
    if typing.get_origin(base) in (typing.Union, types.UnionType):  # e.g. AsyncMode | str: the first that fits
        first: ValueError | None = None
        for arg in typing.get_args(base):
            try:
                return convert(arg, value, key)
            except ValueError as e:
                first = first or e
        assert first is not None
        raise first
    if isinstance(base, type) and dataclasses.is_dataclass(base):
        return value if isinstance(value, base) else build(base, value, key)
    if base is bool:
        return require_bool(value, key)
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return _enum(base, value, key)
    if base is int:
        return require_int(value, key, low=-MAX_COUNT, high=MAX_COUNT)
    if base is float:
        if key.endswith("_s"):
            return float(require_number(value, key, low=0, high=MAX_SECONDS))
        return float(require_number(value, key))
    if base is str:  # a class bounds its own (a --chaos list may be long: chaos.faults)
        return require_str(value, key, max_len=MAX_CONFIG_BYTES)
    if base is Path or base is os.PathLike or typing.get_origin(base) is os.PathLike:
        return require_str(value if not isinstance(value, os.PathLike) else os.fspath(value), key)
    origin = typing.get_origin(base)
    if origin in (tuple, list, frozenset, set):
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise ValueError(f"{key} must be a list, got {kind(value)}")
        item = typing.get_args(base)[0]
        items = [convert(item, v, f"{key} entry") for v in value]
        return origin(items) if origin is not tuple else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {kind(value)}")
        k_type, v_type = typing.get_args(base)
        out = {}
        for k, v in value.items():
            k = _key(k_type, k, key)
            out[k] = convert(v_type, v, _join(key, k))
        return out
    raise TypeError(f"{key}: a {base!r} cannot be written in a config file")  # a programming error


def _enum(cls: type[enum.Enum], value: Any, key: str) -> enum.Enum:
    if isinstance(value, cls):
        return value
    values = {m.value: m for m in cls.__members__.values()}  # members only (an IntFlag would take any int)
    if (isinstance(value, str) or (issubclass(cls, int) and isinstance(value, int) and not isinstance(value, bool))) \
            and value in values:
        return values[value]
    raise ValueError(f"{key} must be one of {list(values)}, got {value!r}")


def _key(tp: Any, k: Any, key: str) -> Any:
    if tp is int:
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)
        return require_int(k, f"{key} key", low=-MAX_COUNT, high=MAX_COUNT)
    return convert(tp, k, f"{key} key")


def _join(key: str, name: Any) -> str:
    return f"{key}.{name}" if key else str(name)


def build(cls: type[T], data: Any, key: str, *, skip: Iterable[str] = (), root: str | None = None) -> T:
    """``cls`` from the mapping ``data`` found at ``key``; ``skip`` names dotted keys (from ``root``) left out."""
    kwargs = build_kwargs(cls, data, key, skip=skip, root=root)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(_keyed(cls, key, str(e))) from None
    except TypeError as e:
        if "missing" not in str(e) or "required" not in str(e):
            raise
        missing = str(e).rpartition(":")[2].strip().strip("'")  # a required field left out
        raise ValueError(f"{_join(key, missing)} is required") from None


def _keyed(cls: type, key: str, message: str) -> str:
    """A class's own message, its field named by its dotted key: ``CheckpointConfig.keep_last must ...`` or
    ``keep_last must ...`` at key ``checkpoint`` reads ``checkpoint.keep_last must ...``; ``hang.x`` at
    ``monitors.hang`` reads ``monitors.hang.x``."""
    if not key:
        return message
    head = message.split(" ", 1)[0]
    tail = key.rpartition(".")[2]
    for prefix in (f"{cls.__name__}.", f"{tail}."):
        if head.startswith(prefix):
            return f"{key}.{message[len(prefix):]}"
    if head.split(".")[0].rstrip(":") in {f.name for f in dataclasses.fields(cls)}:
        return f"{key}.{message}"
    return message if head.startswith(key) else f"{key}: {message}"


def build_kwargs(cls: type, data: Any, key: str, *, skip: Iterable[str] = (), root: str | None = None
                 ) -> dict[str, Any]:
    """The keyword arguments :func:`build` passes to ``cls``, each converted to its field's type."""
    if not isinstance(data, dict):
        raise ValueError(f"{key or 'the config'} must be a mapping, got {kind(data)}")
    root = key if root is None else root
    prefix = (key[len(root):].lstrip(".") + ".") if key != root else ""
    skip = set(skip)
    fields = {n: t for n, t in hints(cls).items() if f"{prefix}{n}" not in skip}
    old = getattr(cls, "__config_renamed__", {})
    kwargs: dict[str, Any] = {}
    unknown = []
    for name, value in data.items():
        if isinstance(name, str) and name in old:
            _deprecated(cls, _join(key, name), _join(key, old[name]))
            name = old[name]
        if not isinstance(name, str) or name not in fields:
            unknown.append(repr(name) if not isinstance(name, str) else name)
            continue
        sub = dataclass_in(fields[name])
        if sub is not None and isinstance(value, dict):
            kwargs[name] = build(sub, value, _join(key, name), skip=skip, root=root)
        else:
            kwargs[name] = convert(fields[name], value, _join(key, name))
    if unknown:
        where = f"{key}: unknown" if key else "unknown"
        raise ValueError(f"{where} key(s) {sorted(unknown)}; expected some of {sorted(fields)}")
    return kwargs


def to_plain(obj: Any, *, skip: Iterable[str] = (), prefix: str = "") -> Any:
    """``obj`` as plain data (mappings, lists, strings, numbers, booleans, null), ``skip``'s keys left out."""
    skip = set(skip)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name), skip=skip, prefix=f"{prefix}{f.name}.")
                for f in dataclasses.fields(obj) if f.init and f"{prefix}{f.name}" not in skip}
    if isinstance(obj, enum.Enum):
        return int(obj) if isinstance(obj, int) else obj.value
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (frozenset, set)):
        return sorted(to_plain(v) for v in obj)
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {to_plain(k): to_plain(v) for k, v in obj.items()}
    return obj


def parse_text(tp: Any, text: str, key: str) -> Any:
    """One flag's text as plain data of type ``tp``: a string field takes the text as it is; anything else is
    read as one YAML value (``5``, ``true``, ``null``, ``[a, b]``, ``{forward: 10}``)."""
    base, optional = _parts(tp)
    if optional and text in ("null", "~", "none", "None"):
        return None
    if base is str or base is Path or typing.get_origin(base) is os.PathLike or (
            isinstance(base, type) and issubclass(base, enum.Enum) and not issubclass(base, int)):
        return text
    if base in (int, float):  # as Python reads a number: 1e5 and 1_000 too (YAML would take 1e5 for a string)
        try:
            number = int(text) if base is int else float(text)
        except ValueError:
            pass
        else:
            if isinstance(number, float) and not math.isfinite(number):
                raise ValueError(f"{key} must be a finite number, got {text!r}")
            return number
    try:
        value = yaml.load(text, Loader=_PlainLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError:
        raise ValueError(f"{key}: {text!r} is not a value (write lists as [a, b], mappings as {{k: v}})") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {text!r}")
    return value


# --------------------------------------------------------- old field names
class _Alias:
    """The old name of a renamed field, read and written through the new one (it warns)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        _deprecated(owner, f"{owner.__name__}.{self.old}", f"{owner.__name__}.{self.new}")
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        _deprecated(type(obj), f"{type(obj).__name__}.{self.old}", f"{type(obj).__name__}.{self.new}")
        setattr(obj, self.new, value)


def _deprecated(cls: type, old: str, new: str) -> None:
    if (cls.__qualname__, old) not in _WARNED:
        _WARNED.add((cls.__qualname__, old))
        warnings.warn(f"{old} is deprecated: use {new} (the old name goes in the next release)",
                      DeprecationWarning, stacklevel=3)


def renamed(**old_to_new: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: ``old=new`` keeps keyword ``old`` (and attribute ``old``) working as ``new``, warning."""

    def wrap(cls: type[T]) -> type[T]:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, **kwargs: Any) -> None:
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{cls.__name__}: {old} and {new} are one field (give {new})")
                    _deprecated(cls, f"{cls.__name__}({old}=...)", f"{cls.__name__}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            init(self, **kwargs)

        cls.__init__ = __init__  # type: ignore[method-assign]
        cls.__config_renamed__ = {**getattr(cls, "__config_renamed__", {}), **old_to_new}  # type: ignore[attr-defined]
        for old, new in old_to_new.items():
            setattr(cls, old, _Alias(old, new))
        return cls

    return wrap


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """Sets dotted ``key`` in nested plain ``data``, making (or replacing a null with) the mappings on the way."""
    *path, last = key.split(".")
    for name in path:
        if not isinstance(data.get(name), dict):
            data[name] = {}
        data = data[name]
    data[last] = value
