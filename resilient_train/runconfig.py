"""``RunConfig``: the whole run's configuration, one root over the components' own dataclasses.

==============  =========================  ====================================
section         class                      read by
==============  =========================  ====================================
``supervisor``  ``SupervisorConfig``       every rank (the training loop)
``agent``       ``AgentConfig``            the node agent (torchrun's flags)
``monitors``    ``MonitorConfig``          the agent: hangs, stragglers, metrics
``checkpoint``  ``CheckpointConfig|None``  every rank: disk checkpoints
``rerun``       ``RerunConfig``            every rank: result validation
``preemption``  ``PreemptionConfig``       every rank: stop on a signal
``dashboard``   ``DashboardConfig|None``   the agent: the live page
==============  =========================  ====================================

A field has one dotted name in Python (``run.checkpoint.interval``), in YAML
(``checkpoint: {interval: 5}``) and on the command line
(``--checkpoint.interval=5``). A component that holds another section
(``SupervisorConfig.checkpoint``, ``AgentConfig.monitor``) holds the root's
object: the root keeps them one (:data:`LINKS`). Every duration ends in ``_s``.

``resilient-train run`` builds one from ``--config FILE``, then torchrun's and
the older flags, then ``--SECTION.FIELD=VALUE`` (each layer wins over the one
before), writes it to ``RUN_DIR/run-config.yaml`` and names that file to its
ranks (``RT_RUN_CONFIG``). A rank takes it in one place, when the script asks:
``SupervisorConfig.from_run_config(**given)`` (``rt.Supervisor()`` with no
config does); no config class reads it in its constructor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import yaml

from checkpointing import CheckpointConfig
from monitors import MonitorConfig
from resilient_train.base.configfile import load_config_file
from resilient_train.base.configtree import (build, convert, dataclass_in, leaf_keys, parse_text, set_key,
                                 to_plain, type_at)
from monitors.dashboard.server import DashboardConfig
from resilient_train.agent.config import AgentConfig
from resilient_train.rank.config import ROOT_SECTIONS, SupervisorConfig
from resilient_train.rank.preempt import PreemptionConfig
from resilient_train.rank.rerun import RerunConfig

__all__ = ["LINKS", "PYTHON_ONLY", "RUN_CONFIG_FILE", "RunConfig"]

RUN_CONFIG_FILE = "run-config.yaml"  # in the run directory: the effective config, as the ranks read it
# A component's field that is a section of the root: (component.field) -> section.
LINKS: dict[str, str] = {
    **{f"supervisor.{name}": section for name, section in ROOT_SECTIONS.items()},
    "agent.monitor": "monitors",
    "agent.dashboard": "dashboard",
}
# Fields no file or flag can hold: set them in Python.
PYTHON_ONLY: dict[str, str] = {"rerun.checks": "callables (StepResult -> None or a reason)"}
SKIP = frozenset(LINKS) | frozenset(PYTHON_ONLY)


@dataclass(kw_only=True)
class RunConfig:
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    monitors: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig | None = None
    rerun: RerunConfig = field(default_factory=RerunConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    dashboard: DashboardConfig | None = None

    def __post_init__(self) -> None:
        """A section given to its component only (``SupervisorConfig(checkpoint=...)``) becomes the root's; given
        both ways, differently, is an error. Then every component holds the root's sections."""
        defaults = {"checkpoint": None, "rerun": RerunConfig(), "preemption": PreemptionConfig(),
                    "monitors": MonitorConfig(), "dashboard": None}
        changes: dict[str, dict[str, Any]] = {}
        for link, section in LINKS.items():
            owner, name = link.split(".")
            held, ours = getattr(getattr(self, owner), name), getattr(self, section)
            if held is ours:
                continue
            if held != defaults[section] and held != ours:
                if ours != defaults[section]:
                    raise ValueError(f"RunConfig: {link} and {section} differ: set {section} only")
                setattr(self, section, held)
                ours = held
            changes.setdefault(owner, {})[name] = ours
        for owner, values in changes.items():
            setattr(self, owner, replace(getattr(self, owner), **values))

    # ------------------------------------------------------------ plain data
    @classmethod
    def from_dict(cls, data: Any, *, label: str = "run config") -> "RunConfig":
        """From plain data (a YAML mapping of sections); every mistake is a one-line ``ValueError`` naming the key.

        A ``checkpoint`` section without a ``directory`` writes under ``RUN_DIR/checkpoints``."""
        data = {} if data is None else data
        try:
            if not isinstance(data, dict):
                raise ValueError(f"must be a mapping of sections {list(SECTIONS)}, got {type(data).__name__}")
            ckpt = data.get("checkpoint")
            if isinstance(ckpt, dict) and "directory" not in ckpt:
                agent = data.get("agent") if isinstance(data.get("agent"), dict) else {}
                run_dir = agent.get("run_dir", AgentConfig.run_dir) if isinstance(agent, dict) else AgentConfig.run_dir
                data = {**data, "checkpoint": {**ckpt, "directory": str(Path(str(run_dir)) / "checkpoints")}}
            return build(cls, data, "", skip=SKIP)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> "RunConfig":
        """From a YAML (or JSON) file: plain data only, bounded (``resilient_train.base.configfile``)."""
        return cls.from_dict(load_config_file(path, "run config"), label=f"run config {str(path)!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :meth:`from_dict` reads back to an equal config (:data:`PYTHON_ONLY` left out)."""
        return to_plain(self, skip=SKIP)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Writes :meth:`to_yaml` to ``path`` atomically, readable by this user only."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_yaml())
        os.replace(tmp, path)
        return path

    # ------------------------------------------------------------- overrides
    def with_overrides(self, overrides: Iterable[str]) -> "RunConfig":
        """A copy with ``KEY=VALUE`` items applied (``--checkpoint.interval=5``, ``agent.nproc_per_node=2``).

        A value is read as its field's type: a string as it is, anything else as one YAML value
        (``true``, ``null``, ``[a, b]``, ``{forward: 10}``)."""
        data = self.to_dict()
        for item in overrides:
            key, value = parse_override(item)
            set_key(data, key, value)
        new = RunConfig.from_dict(data, label="run config overrides")
        if self.rerun.checks:  # PYTHON_ONLY: carried over as they are
            rerun = replace(new.rerun, checks=list(self.rerun.checks))
            new = replace(new, rerun=rerun, supervisor=replace(new.supervisor, rerun=rerun))
        return new

    @staticmethod
    def keys() -> list[tuple[str, Any, Any]]:
        """Every key a file or a flag may set: (dotted key, type, default), in section order."""
        return leaf_keys(RunConfig, skip=SKIP)


SECTIONS: dict[str, type] = {"supervisor": SupervisorConfig, "agent": AgentConfig, "monitors": MonitorConfig,
                             "checkpoint": CheckpointConfig, "rerun": RerunConfig, "preemption": PreemptionConfig,
                             "dashboard": DashboardConfig}


def parse_override(item: str) -> tuple[str, Any]:
    """``--KEY=VALUE`` (or ``KEY=VALUE``) as (key, plain value of the key's type); ``ValueError`` naming it."""
    key, sep, text = item.removeprefix("--").partition("=")
    if not sep:
        raise ValueError(f"{item!r}: expected --SECTION.FIELD=VALUE")
    return key, parse_key_value(key, text)


def parse_key_value(key: str, text: str) -> Any:
    """One key's value from its text: the key must exist (and not be Python-only), the value be of its type."""
    if key in SKIP:
        raise ValueError(f"{key}: " + (f"set {LINKS[key]}.* instead" if key in LINKS
                                       else f"{PYTHON_ONLY[key]}: set it in Python"))
    try:
        tp = type_at(RunConfig, key)
    except KeyError as e:
        raise ValueError(f"unknown key {e.args[0]!r} (python -m resilient_train.configdoc lists them)") from None
    value = parse_text(tp, text, key)
    if dataclass_in(tp) is None:  # a whole section is checked when the config is built
        convert(tp, value, key)
    return value
