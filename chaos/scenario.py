"""Scenario files: the job, the schedule and the invariants, in YAML.

    name: kill-during-backward
    job:
      script: ../../examples/train_gpt.py     # relative to this file, else to the working directory
      args: [--d-model, "32", --layers, "2"]
      ranks: 2
      steps: 24                               # passed as `--steps 24` (steps_arg; null: not passed)
      monitor: {hang: {default_timeout: 5}}   # monitors.MonitorConfig, for `run --monitor-config`
    schedule:
      faults:                                 # a fixed list ...
        - {kind: kill, rank: 0, step: 6, phase: backward}
      # random: {seed: 7, count: 30, mtbf_steps: 40, kinds: [kill, raise, hang]}   # ... or random
    invariants: {detect_timeout_s: 20, max_steps_redone: 1}
    timeout_s: 300

Every mistake raises ``ValueError`` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chaos.schedule import FixedSchedule, PlannedFault, RandomSchedule, Schedule

__all__ = ["Invariants", "JobSpec", "Scenario", "load_scenario", "scenario_from_dict"]


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    script: str
    args: tuple[str, ...] = ()
    ranks: int = 2
    steps: int = 20
    steps_arg: str | None = "--steps"
    monitor: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int | None = None  # default: enough for every planned fault, twice
    spare: bool = True
    checkpoint_dir: str = "checkpoints"  # relative to the run directory: watched for an invalid `latest`

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"job.ranks must be >= 1, got {self.ranks}")
        if self.steps < 1:
            raise ValueError(f"job.steps must be >= 1, got {self.steps}")
        if not Path(self.script).is_file():
            raise ValueError(f"job.script {self.script!r} does not exist")

    def argv(self) -> list[str]:
        extra = [self.steps_arg, str(self.steps)] if self.steps_arg else []
        return [self.script, *self.args, *extra]


@dataclass(frozen=True, kw_only=True)
class Invariants:
    completes: bool = True  # exit 0 with a final state, within the scenario's timeout
    bitwise: bool = True  # final state bitwise equal to the fault-free reference
    valid_latest: bool = True  # no checkpoint that fails verification was ever `latest`
    recovered: bool = True  # every fault fired, was detected and recovered within its timeouts
    detect_timeout_s: float = 30.0
    recover_timeout_s: float = 60.0  # from injection to every rank training again
    max_steps_redone: int = 2
    min_faults: int = 0  # at least this many faults must have fired

    def __post_init__(self) -> None:
        for name in ("detect_timeout_s", "recover_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"invariants.{name} must be > 0, got {getattr(self, name)}")
        if self.max_steps_redone < 0 or self.min_faults < 0:
            raise ValueError("invariants.max_steps_redone and invariants.min_faults must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    job: JobSpec
    schedule: Schedule
    invariants: Invariants = field(default_factory=Invariants)
    timeout_s: float = 600.0  # the faulted run is killed past this: "completes" fails, nothing hangs
    description: str = ""

    def plan(self) -> list[PlannedFault]:
        return self.schedule.plan(world_size=self.job.ranks, steps=self.job.steps)

    def with_changes(self, **changes: Any) -> "Scenario":
        return dataclasses.replace(self, **changes)


def load_scenario(path: str | os.PathLike[str]) -> Scenario:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"scenario file {str(p)!r} does not exist") from None
    except yaml.YAMLError as e:
        raise ValueError(f"scenario {str(p)!r}: not valid YAML: {str(e).splitlines()[0]}") from None
    try:
        return scenario_from_dict(data, base=p.parent, default_name=p.stem)
    except ValueError as e:
        raise ValueError(f"scenario {str(p)!r}: {e}") from None


def scenario_from_dict(data: Any, *, base: Path | None = None, default_name: str = "scenario") -> Scenario:
    """A scenario from plain data; relative script paths resolve against ``base``, then the working directory."""
    _mapping(data, "the scenario")
    _known(data, {"name", "description", "job", "schedule", "invariants", "timeout_s"}, "the scenario")
    for required in ("job", "schedule"):
        if required not in data:
            raise ValueError(f"missing section {required!r}")
    job = _job(data["job"], base)
    schedule = _schedule(data["schedule"], job.ranks)
    inv = _build(Invariants, data.get("invariants") or {}, "invariants")
    timeout = float(data.get("timeout_s", 600.0))
    if timeout <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout}")
    scenario = Scenario(name=str(data.get("name", default_name)), job=job, schedule=schedule, invariants=inv,
                        timeout_s=timeout, description=str(data.get("description", "")))
    scenario.plan()  # a schedule that does not fit the job is an error now, not mid-run
    return scenario


def _job(data: Any, base: Path | None) -> JobSpec:
    _mapping(data, "job")
    d = dict(data)
    if "script" not in d:
        raise ValueError("job.script is required")
    script = Path(str(d["script"]))
    if not script.is_absolute() and base is not None and (base / script).is_file():
        script = base / script
    d["script"] = str(script.resolve())
    if not isinstance(d.get("args", []), list):
        raise ValueError("job.args must be a list of strings")
    d["args"] = tuple(str(a) for a in d.get("args", []))
    for name in ("monitor", "env"):
        if name in d:
            _mapping(d[name], f"job.{name}")
    if "env" in d:
        d["env"] = {str(k): str(v) for k, v in d["env"].items()}
    return _build(JobSpec, d, "job")


def _schedule(data: Any, world_size: int) -> Schedule:
    _mapping(data, "schedule")
    _known(data, {"faults", "random"}, "schedule")
    if ("faults" in data) == ("random" in data):
        raise ValueError("schedule: give exactly one of 'faults' (a fixed list) and 'random'")
    if "random" in data:
        r = dict(data["random"] or {})
        for name in ("kinds", "phases", "ranks"):
            if name in r:
                if not isinstance(r[name], list):
                    raise ValueError(f"schedule.random.{name} must be a list")
                r[name] = tuple(r[name])
        return _build(RandomSchedule, r, "schedule.random")
    if not isinstance(data["faults"], list):
        raise ValueError("schedule.faults must be a list")
    faults = []
    for i, f in enumerate(data["faults"]):
        _mapping(f, f"schedule.faults[{i}]")
        f = dict(f)
        rank = f.pop("rank", f.pop("ranks", 0))
        if rank == "all":
            rank = list(range(world_size))
        f["ranks"] = tuple(rank) if isinstance(rank, list) else (rank,)
        try:
            faults.append(_build(PlannedFault, f, f"schedule.faults[{i}]"))
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith("schedule.") else f"schedule.faults[{i}]: {e}") from None
    return FixedSchedule(faults=tuple(faults))


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    _known(data, names, where)
    try:
        return cls(**data)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None


def _mapping(data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")


def _known(data: dict[str, Any], names: set[str], where: str) -> None:
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected some of {sorted(names)}")
