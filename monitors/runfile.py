"""The run config file a rank's configs default from: ``RT_RUN_CONFIG``, which the agent sets for its ranks.

* :func:`file_defaults`: a field a caller leaves out takes its value from the
  file's section (``RUN_DIR/run-config.yaml``: the agent's effective config,
  ``--config`` and ``--SECTION.FIELD=VALUE`` included); a value the caller
  passes always wins, and with ``say_overrides`` the runtime says once when it
  wins over a value the file sets (``--checkpoint.interval=25`` while the
  script passes its own checkpoint config), so nothing is dropped in silence;
* :func:`file_section` reads one section; a variable that names no run config
  (one left in a user's shell) is one line naming it
  (:class:`~monitors.configtree.RunConfigVariableError`).

The fields' own defaults (``--help``, the docs) never read the file
(:data:`~monitors.configtree.FROM_FILE`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any, Callable, Iterable, TypeVar

from monitors.configfile import kind, load_config_file
from monitors.configtree import (FROM_FILE, RT_RUN_CONFIG, RunConfigVariableError, build_kwargs, convert,
                                 dataclass_in, field_default, hints)

__all__ = ["file_defaults", "file_section"]

T = TypeVar("T")

_CACHE: dict[tuple[str, int, int], Any] = {}
_SAID: set[tuple[type, str]] = set()  # (class, field) whose override by the script was said, in this process
# The agent sets the variable for its ranks; one left in a user's shell is the usual way to meet a bad one.
_UNSET = f" (the agent sets ${RT_RUN_CONFIG} for its ranks: unset it to run without)"


def _file_root(environ: "os._Environ[str] | dict[str, str] | None" = None) -> dict[str, Any] | None:
    path = (os.environ if environ is None else environ).get(RT_RUN_CONFIG)
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError as e:
        raise RunConfigVariableError(f"run config ${RT_RUN_CONFIG} {path!r} cannot be read: {e.strerror or e}{_UNSET}") from None
    ident = (path, st.st_mtime_ns, st.st_size)
    if ident not in _CACHE:
        try:
            data = load_config_file(path, f"run config (${RT_RUN_CONFIG})")
        except ValueError as e:
            raise RunConfigVariableError(f"{e}{_UNSET}") from None
        if data is not None and not isinstance(data, dict):
            raise RunConfigVariableError(f"run config ${RT_RUN_CONFIG} {path!r} must be a mapping of sections, got {kind(data)}"
                             f"{_UNSET}")
        _CACHE.clear()
        _CACHE[ident] = data or {}
    return _CACHE[ident]


def file_section(section: str, environ: "os._Environ[str] | dict[str, str] | None" = None) -> Any:
    """The plain data at dotted ``section`` of the run config file named by ``RT_RUN_CONFIG``; ``None`` when
    there is no such variable or no such section."""
    data: Any = _file_root(environ)
    for name in section.split("."):
        if not isinstance(data, dict) or name not in data:
            return None
        data = data[name]
    return data


def file_defaults(section: str, *, links: dict[str, str] | None = None, skip: Iterable[str] = (),
                  say_overrides: bool = False) -> Callable[[type[T]], type[T]]:
    """Class decorator: in a process whose environment names a run config file (``RT_RUN_CONFIG``), the
    fields a caller leaves out take their values from that file's ``section``; ``links`` maps a field to
    another section that holds it (the supervisor's ``checkpoint`` is the file's ``checkpoint``). Values the
    caller passes win; without the variable nothing changes. ``say_overrides``: a value passed over one the
    file sets is said once (the class a script builds from the run config, not the ones it composes)."""
    links = dict(links or {})
    skip = frozenset(skip) | frozenset(links)

    def wrap(cls: type[T]) -> type[T]:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, **kwargs: Any) -> None:
            if os.environ.get(RT_RUN_CONFIG) and FROM_FILE.get():
                if say_overrides:
                    _say_overridden(cls, section, links, skip, kwargs)
                kwargs = {**_file_kwargs(cls, section, links, skip, set(kwargs)), **kwargs}
            init(self, **kwargs)

        cls.__init__ = __init__  # type: ignore[method-assign]
        cls.__run_config__ = (section, links, skip)  # type: ignore[attr-defined]
        return cls

    return wrap


def _file_kwargs(cls: type, section: str, links: dict[str, str], skip: frozenset[str], given: set[str]
                 ) -> dict[str, Any]:
    where = f"run config (${RT_RUN_CONFIG}) {section}"
    data = file_section(section)
    out = build_kwargs(cls, {k: v for k, v in data.items() if k not in given and k not in skip}, where) \
        if isinstance(data, dict) else {}
    root = _file_root() or {}
    types_ = hints(cls)
    for name, other in links.items():
        if name not in given and other in root:
            out[name] = convert(types_[name], root[other], f"run config (${RT_RUN_CONFIG}) {other}")
    return out


def _say_overridden(cls: type, section: str, links: dict[str, str], skip: frozenset[str], given: dict[str, Any]
                    ) -> None:
    """A value the script passes wins over the run config's: said once a process (rank 0's), for a key the run
    config sets to something else than the field's own default (a user's --KEY=VALUE or --config), so that
    ``--checkpoint.interval=25`` is never dropped in silence."""
    if os.environ.get("RANK", "0") != "0":
        return
    data, root, types_ = file_section(section), _file_root() or {}, hints(cls)
    own = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in given.items():
        if name in links:
            key, present, raw = links[name], links[name] in root, root.get(links[name])
        else:
            key = f"{section}.{name}"
            present = isinstance(data, dict) and name in data and name not in skip
            raw = data.get(name) if isinstance(data, dict) else None
        if not present or name not in own or (cls, name) in _SAID:
            continue
        try:
            theirs = convert(types_[name], raw, key)
        except ValueError:  # a bad value: the run config's own check says so
            continue
        if theirs == value or theirs == field_default(own[name]):
            continue
        _SAID.add((cls, name))
        shown = key if dataclass_in(types_[name]) is not None else f"{key}={raw!r}"
        print(f"resilient-train: the run config's {shown} is not used: the script passes "
              f"{cls.__name__}({name}={_brief(value)}), which wins (leave {name} out to take the run config's)",
              file=sys.stderr, flush=True)


def _brief(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return f"{type(value).__name__}(...)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
