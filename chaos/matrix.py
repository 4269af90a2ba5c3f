"""``chaos matrix``: every fault kind at every phase on a small job, and a pass/fail table.

Cells are packed into jobs (several faults per job, each at its own step and
rank) so the whole matrix costs a few job start-ups, not one per cell. A cell
passes when its fault fired, was detected and recovered within the limits,
and its job completed bitwise equal to the shared fault-free reference.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.runner import ScenarioResult, run_scenario
from chaos.scenario import Invariants, JobSpec, Scenario
from chaos.schedule import CORRUPT_CKPT, DRIVER_KINDS, FixedSchedule, PlannedFault, all_kinds
from chaos.faults import VALUE_KINDS as _VALUE_KINDS, Phase
from monitors import max_local_ranks

__all__ = ["MatrixConfig", "MatrixResult", "run_matrix"]

_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
# Results are validated (the rerun state machine is on) so value faults are judged; every job shares one reference.
SMALL_GPT = ("--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4", "--log-every", "0",
             "--rerun-mode", "validate_results")
# Kinds the runtime cannot survive yet stay out of the default matrix (see the README's chaos section).
UNSUPPORTED: tuple[str, ...] = (CORRUPT_CKPT,)
_DURATIONS = {"slow": 1.0, "store-outage": 1.5}
# Kinds whose recovery passes through the 'heal' phase (a new generation).
RECOVERING = frozenset({"kill", "raise", "hang", "spin", "block", "deadlock", "term", "netbreak"})
# Value faults act on the loss or the gradients of their step, whatever the phase: one column, like driver kinds.
VALUE_KINDS = frozenset(k.value for k in _VALUE_KINDS)
# A genuine loss spike is skipped by policy: the state cannot equal a run without it. Its own job, no bitwise check.
NOT_BITWISE: frozenset[str] = frozenset({"spike"})
# The quick matrix's phase per kind. A hang "at" the optimizer phase reads, to the hang detector, as a
# rank still in the all-reduce, beside peers waiting in the next one (see the README's chaos section).
QUICK_PHASES = {"kill": "optimizer", "raise": "forward", "hang": "backward", "spin": "all-reduce", "block": "data",
                "deadlock": "optimizer",
                "slow": "between-steps", "term": "heal", "netbreak": "all-reduce", "nan": "forward",
                "bitflip": "backward", "spike": "forward"}


def _family(kind: str) -> int:
    """Cells of one family share jobs: 0 compared bitwise, 1 not."""
    return 1 if kind in NOT_BITWISE else 0


def _default_kinds() -> tuple[str, ...]:
    return tuple(k for k in all_kinds() if k not in UNSUPPORTED)


@dataclass(frozen=True, kw_only=True)
class MatrixConfig:
    kinds: tuple[str, ...] = field(default_factory=_default_kinds)
    phases: tuple[str, ...] = tuple(p.value for p in Phase)
    quick: bool = False  # every kind once, at rotating phases, instead of every kind at every phase
    ranks: int = 2
    faults_per_job: int = 7
    steps_per_fault: int = 6
    warmup_steps: int = 6  # before the first fault: lets hang timeouts be computed from observed steps
    script: str = str(_EXAMPLE)
    args: tuple[str, ...] = SMALL_GPT
    timeout_s: float = 420.0  # per job
    invariants: Invariants = field(default_factory=lambda: Invariants(
        detect_timeout_s=35.0, recover_timeout_s=90.0, max_steps_redone=1))
    monitor: dict[str, Any] = field(default_factory=lambda: {
        "hang": {"idle_timeout_s": 10.0, "busy_timeout_s": 10.0, "long_section_timeout_s": 30.0},
        "metrics": {"prometheus": False, "tensorboard": False},
    })

    def __post_init__(self) -> None:
        for k in self.kinds:
            if k not in all_kinds():
                raise ValueError(f"matrix: unknown kind {k!r}; expected some of {', '.join(all_kinds())}")
        for p in self.phases:
            if p not in {ph.value for ph in Phase}:
                raise ValueError(f"matrix: unknown phase {p!r}; expected some of {', '.join(ph.value for ph in Phase)}")
        if self.ranks < 2:
            raise ValueError("matrix: at least 2 ranks (a fault needs a survivor)")
        if self.ranks > max_local_ranks():
            raise ValueError(f"matrix: at most {max_local_ranks()} ranks on this node (4 per CPU core)")
        if self.faults_per_job < 2:
            raise ValueError("matrix: faults_per_job must be >= 2 (a fault in 'heal' needs another fault first)")

    def cells(self) -> list[tuple[str, str]]:
        """(kind, phase) pairs; driver kinds have the phase '-'."""
        single = set(DRIVER_KINDS) | VALUE_KINDS  # the phase does not apply: one column, '-'
        if self.quick:
            return [(k, "-" if k in single else QUICK_PHASES.get(k, self.phases[i % len(self.phases)]))
                    for i, k in enumerate(self.kinds)]
        return [(k, "-") if k in single else (k, p) for k in self.kinds for p in self.phases
                if not (k in single and p != self.phases[0])]


@dataclass(kw_only=True)
class MatrixResult:
    cells: dict[tuple[str, str], tuple[bool, str]]  # (kind, phase) -> (passed, why)
    jobs: list[ScenarioResult]

    @property
    def ok(self) -> bool:
        return all(ok for ok, _ in self.cells.values())

    def table(self) -> str:
        kinds = list(dict.fromkeys(k for k, _ in self.cells))
        phases = list(dict.fromkeys(p for _, p in self.cells))
        lines = ["| kind | " + " | ".join(phases) + " |", "| --- |" + " --- |" * len(phases)]
        for k in kinds:
            row = [("PASS" if self.cells[(k, p)][0] else "**FAIL**") if (k, p) in self.cells else "" for p in phases]
            lines.append(f"| {k} | " + " | ".join(row) + " |")
        return "\n".join(lines)


def _pack(config: MatrixConfig) -> list[list[tuple[str, str]]]:
    groups = []
    per_job = max(len(config.cells()), 1) if config.quick else config.faults_per_job
    for fam in (0, 1):
        part = [c for c in config.cells() if _family(c[0]) == fam]
        order = {c: i for i, c in enumerate(part)}
        # Within a job, a fault in 'heal' fires at the first recovery: keep it behind a fault that causes one.
        part.sort(key=lambda c: (order[c] // per_job, c[1] == "heal"))
        groups += [part[i:i + per_job] for i in range(0, len(part), per_job)]
    return groups


def _scenario(config: MatrixConfig, name: str, group: list[tuple[str, str]], steps: int) -> Scenario:
    faults = []
    for j, (kind, phase) in enumerate(group):
        step = None if phase == "heal" else config.warmup_steps + j * config.steps_per_fault
        if phase == "-" and kind in VALUE_KINDS:
            phase = "forward"  # recorded, not used: value faults act on their step's loss or gradients
        faults.append(PlannedFault(kind=kind, ranks=(j % config.ranks,), phase=None if phase == "-" else phase,
                                   step=step, duration_s=_DURATIONS.get(kind)))
    if any(p == "heal" for _, p in group) and not any(k in RECOVERING and p != "heal" for k, p in group):
        # A fault in 'heal' needs a recovery to happen in: a raise on another rank, after the cells, starts one.
        faults.append(PlannedFault(kind="raise", ranks=(1 % config.ranks,), phase="forward",
                                   step=config.warmup_steps + len(group) * config.steps_per_fault))
    job = JobSpec(script=config.script, args=config.args, ranks=config.ranks, steps=steps, monitor=config.monitor)
    inv = config.invariants if _family(group[0][0]) == 0 else dataclasses.replace(config.invariants, bitwise=False)
    return Scenario(name=name, job=job, schedule=FixedSchedule(faults=tuple(faults)),
                    invariants=inv, timeout_s=config.timeout_s,
                    description="chaos matrix job: " + ", ".join(f"{k}@{p}" for k, p in group))


def _verdicts(config: MatrixConfig, group: list[tuple[str, str]], res: ScenarioResult) -> tuple[list[tuple[bool, str]], bool]:
    """Per cell (passed, why), and whether the job as a whole broke (completes, bitwise, valid_latest)."""
    inv = config.invariants
    job_bad = [c for c in res.checks if not c.ok and c.name in ("completes", "bitwise", "valid_latest")]
    out = []
    for tl in res.timelines[:len(group)]:  # a helper fault, if any, comes last
        why = []
        if tl.injected is None:
            why.append("never fired")
        elif not tl.tolerated and (tl.detect_s is None or tl.detect_s > inv.detect_timeout_s):
            why.append("not detected in time")
        if tl.injected is not None and (tl.recover_s is None or tl.recover_s > inv.recover_timeout_s):
            why.append("not recovered in time")
        if (tl.steps_redone or 0) > inv.max_steps_redone:
            why.append(f"{tl.steps_redone} steps redone")
        why += [f"job: {c.name} broken" for c in job_bad]
        out.append((not why, "; ".join(why) or f"recovered in {_s(tl.recover_s)}"))
    return out, bool(job_bad)


def run_matrix(config: MatrixConfig, *, out_dir: str | Path, cache_dir: str | Path | None = None,
               echo: bool = True) -> MatrixResult:
    """Runs the packed jobs; when a job as a whole breaks, each of its cells runs again alone, so the table
    blames the cell that broke it rather than every cell that shared the job."""
    out = Path(out_dir)
    groups = _pack(config)
    steps = config.warmup_steps + max(len(g) for g in groups) * config.steps_per_fault + config.steps_per_fault
    cells: dict[tuple[str, str], tuple[bool, str]] = {}
    jobs = []

    def run(name: str, group: list[tuple[str, str]], label: str) -> tuple[list[tuple[bool, str]], bool]:
        scn = _scenario(config, name, group, steps)
        if echo:
            print(f"chaos matrix: {label}: {scn.description.split(': ', 1)[1]}", flush=True)
        res = run_scenario(scn, out_dir=out / name, cache_dir=cache_dir)
        jobs.append(res)
        return _verdicts(config, group, res)

    for n, group in enumerate(groups):
        verdicts, broke = run(f"matrix-{n:02d}", group, f"job {n + 1}/{len(groups)}")
        if broke and len(group) > 1:
            verdicts = [run(f"matrix-{n:02d}-{i}", [cell], f"job {n + 1}, {cell[0]}@{cell[1]} alone")[0][0]
                        for i, cell in enumerate(group)]
            verdicts = [(ok, f"alone: {why}") for ok, why in verdicts]
        for cell, verdict in zip(group, verdicts):
            cells[cell] = verdict
            if echo:
                print(f"  {cell[0]:<13} {cell[1]:<14} {'PASS' if verdict[0] else 'FAIL'}  {verdict[1]}", flush=True)
    result = MatrixResult(cells=cells, jobs=jobs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.md").write_text("# chaos matrix\n\n" + result.table() + "\n\n" + "\n".join(
        f"- {k} at {p}: {'pass' if ok else 'FAIL'}: {why}" for (k, p), (ok, why) in cells.items()) + "\n")
    (out / "matrix.json").write_text(json.dumps(
        {"ok": result.ok, "cells": [{"kind": k, "phase": p, "ok": ok, "detail": why} for (k, p), (ok, why) in cells.items()],
         "jobs": [str(j.out_dir) for j in jobs]}, indent=2))
    return result


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"
