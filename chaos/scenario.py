"""Scenario files: the job, the schedule and the invariants, in YAML.

    name: kill-during-backward
    job:
      script: ../../examples/train_gpt.py     # relative to this file, else to the working directory
      args: [--d-model, "32", --layers, "2"]
      ranks: 2
      steps: 24                               # passed as `--steps 24` (steps_arg; null: not passed)
      monitor: {hang: {idle_timeout_s: 5}} # monitors.MonitorConfig, for `run --monitor-config`
    schedule:
      faults:                                 # a fixed list ...
        - {kind: kill, rank: 0, step: 6, phase: backward}
      # random: {seed: 7, count: 30, mtbf_steps: 40, kinds: [kill, raise, hang]}   # ... or random
    invariants: {detect_timeout_s: 20, max_steps_redone: 1}
    timeout_s: 300

Every mistake raises ``ValueError`` naming the file and the field: the file is
read by ``resilient_train.base.configfile`` (plain YAML, no anchors or aliases, bounded in
size and depth), and every value is type- and range-checked, so a scenario that
loads is one the runner can run and time out. Limits: ``job.ranks`` at most
``monitors.max_local_ranks()`` (the agent's own limit on this node), at most
``chaos.faults.MAX_FAULTS`` faults (they travel to the workers in one
environment variable), ``timeout_s`` at most a week.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.faults import MAX_DURATION_S, MAX_FAULTS
from chaos.schedule import MAX_STEPS, FixedSchedule, PlannedFault, RandomSchedule, Schedule
from monitors import MonitorConfig, max_local_ranks
from resilient_train.base.configfile import (
    check_fields, kind, load_config_file, require_bool, require_int, require_number, require_str,
)

__all__ = ["MAX_TIMEOUT_S", "Invariants", "JobSpec", "Scenario", "load_scenario", "scenario_from_dict"]

MAX_TIMEOUT_S = MAX_DURATION_S  # a scenario is a test: a week is past any that makes sense


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
        require_str(self.script, "job.script")
        if not isinstance(self.args, tuple) or not all(isinstance(a, str) for a in self.args):
            raise ValueError("job.args must be a list of strings")
        limit = max_local_ranks()
        require_int(self.ranks, "job.ranks", low=1)
        if self.ranks > limit:
            raise ValueError(f"job.ranks {self.ranks}: at most {limit} on this node (monitors.max_local_ranks: "
                             f"4 per CPU core)")
        require_int(self.steps, "job.steps", low=1, high=MAX_STEPS)
        require_str(self.steps_arg, "job.steps_arg", allow_none=True)
        if not isinstance(self.monitor, dict):
            raise ValueError(f"job.monitor must be a mapping, got {kind(self.monitor)}")
        try:
            MonitorConfig.from_dict(self.monitor)  # the same checks as `run --monitor-config`
        except ValueError as e:
            raise ValueError(f"job.monitor: {e}") from None
        if not isinstance(self.env, dict) or not all(
                isinstance(k, str) and k and "=" not in k and "\0" not in k and isinstance(v, str) and "\0" not in v
                for k, v in self.env.items()):
            raise ValueError("job.env must map variable names to strings")
        if self.max_restarts is not None:
            require_int(self.max_restarts, "job.max_restarts", low=0, high=10**6)
        require_bool(self.spare, "job.spare")
        require_str(self.checkpoint_dir, "job.checkpoint_dir")
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
        for name in ("completes", "bitwise", "valid_latest", "recovered"):
            require_bool(getattr(self, name), f"invariants.{name}")
        for name in ("detect_timeout_s", "recover_timeout_s"):
            require_number(getattr(self, name), f"invariants.{name}", above=0, high=MAX_TIMEOUT_S)
        require_int(self.max_steps_redone, "invariants.max_steps_redone", low=0, high=MAX_STEPS)
        require_int(self.min_faults, "invariants.min_faults", low=0, high=MAX_FAULTS)


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
    data = load_config_file(p, "scenario")  # names the file in its own errors
    try:
        return scenario_from_dict(data, base=p.parent, default_name=p.stem)
    except ValueError as e:
        raise ValueError(f"scenario {str(p)!r}: {e}") from None


def scenario_from_dict(data: Any, *, base: Path | None = None, default_name: str = "scenario") -> Scenario:
    """A scenario from plain data; relative script paths resolve against ``base``, then the working directory."""
    check_fields(data, {"name", "description", "job", "schedule", "invariants", "timeout_s"}, "the scenario")
    for required in ("job", "schedule"):
        if required not in data:
            raise ValueError(f"missing section {required!r}")
    name = require_str(data.get("name", default_name), "name", max_len=100)
    if not name or name in (".", "..") or "/" in name:  # it names the default report directory
        raise ValueError(f"name must be a plain name (no '/'), got {name!r}")
    description = require_str(data.get("description", ""), "description", max_len=10_000)
    job = _job(data["job"], base)
    schedule = _schedule(data["schedule"], job.ranks)
    inv = _build(Invariants, _optional_mapping(data.get("invariants"), "invariants"), "invariants")
    timeout = require_number(data.get("timeout_s", 600.0), "timeout_s", above=0, high=MAX_TIMEOUT_S)
    scenario = Scenario(name=name, job=job, schedule=schedule, invariants=inv, timeout_s=float(timeout),
                        description=description)
    planned = scenario.plan()  # a schedule that does not fit the job is an error now, not mid-run
    n = sum(1 if f.driver else len(f.ranks) for f in planned)
    if n > MAX_FAULTS:
        raise ValueError(f"schedule: {n} faults; at most {MAX_FAULTS} (they travel to every worker in one "
                         "environment variable, which Linux caps at 128 KiB)")
    return scenario


def _job(data: Any, base: Path | None) -> JobSpec:
    d = dict(check_fields(data, {f.name for f in dataclasses.fields(JobSpec)}, "job"))
    if "script" not in d:
        raise ValueError("job.script is required")
    script = Path(require_str(d["script"], "job.script"))  # type: ignore[arg-type]
    if not script.is_absolute() and base is not None and (base / script).is_file():
        script = base / script
    d["script"] = str(script.resolve())
    args = d.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                             for a in args):
        raise ValueError("job.args must be a list of strings (or numbers)")
    d["args"] = tuple(str(a) for a in args)
    if "monitor" in d:
        d["monitor"] = _optional_mapping(d["monitor"], "job.monitor")
    if "env" in d:
        env = _optional_mapping(d["env"], "job.env")
        for k, v in env.items():
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                raise ValueError(f"job.env.{k} must be a string, got {kind(v)}")
        d["env"] = {str(k): str(v) for k, v in env.items()}
    return _build(JobSpec, d, "job")


def _schedule(data: Any, world_size: int) -> Schedule:
    check_fields(data, {"faults", "random"}, "schedule")
    if ("faults" in data) == ("random" in data):
        raise ValueError("schedule: give exactly one of 'faults' (a fixed list) and 'random'")
    if "random" in data:
        r = dict(_optional_mapping(data["random"], "schedule.random"))
        for name in ("kinds", "phases", "ranks"):
            if name in r:
                if not isinstance(r[name], list):
                    raise ValueError(f"schedule.random.{name} must be a list")
                r[name] = tuple(r[name])
        return _build(RandomSchedule, r, "schedule.random")
    if not isinstance(data["faults"], list):
        raise ValueError(f"schedule.faults must be a list, got {kind(data['faults'])}")
    if len(data["faults"]) > MAX_FAULTS:
        raise ValueError(f"schedule.faults: {len(data['faults'])} faults; at most {MAX_FAULTS} (they travel to "
                         "every worker in one environment variable, which Linux caps at 128 KiB)")
    faults = []
    for i, f in enumerate(data["faults"]):
        f = dict(check_fields(f, {x.name for x in dataclasses.fields(PlannedFault)} | {"rank"},
                              f"schedule.faults[{i}]"))
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
    check_fields(data, {f.name for f in dataclasses.fields(cls)}, where)
    try:
        return cls(**data)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None


def _optional_mapping(data: Any, where: str) -> dict[str, Any]:
    """A mapping with string keys; null is an empty one."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {kind(data)}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ValueError(f"{where}: field names must be strings, got {bad[0]!r}")
    return data
