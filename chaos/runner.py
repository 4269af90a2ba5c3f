"""``run_scenario``: the fault-free reference, the faulted run, the invariants and the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from chaos.driver import JobRun, run_job
from chaos.reference import Reference, default_cache_dir, ensure_reference
from chaos.report import write_report
from chaos.scenario import Scenario
from chaos.schedule import PlannedFault
from chaos.timeline import FaultTimeline, Progress, build_timelines, progress
from chaos.verdict import Check, check_invariants

__all__ = ["ScenarioResult", "run_scenario"]


@dataclass(kw_only=True)
class ScenarioResult:
    scenario: Scenario
    out_dir: Path
    plan: list[PlannedFault]
    run: JobRun
    reference: Reference | None
    checks: list[Check] = field(default_factory=list)
    timelines: list[FaultTimeline] = field(default_factory=list)
    progress: Progress = field(default_factory=lambda: progress([], 0.0))
    reference_progress: Progress | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def broken(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]

    def summary(self) -> str:
        head = f"{self.scenario.name}: {'PASS' if self.ok else 'FAIL'}"
        bad = [f"  {c.name}: {c.detail}" for c in self.checks if not c.ok]
        return "\n".join([head, *bad, f"  report: {self.out_dir / 'report.md'}"])


def _events(run_dir: Path) -> list[dict]:
    from monitors import read_events

    return list(read_events(run_dir / "events.jsonl"))


def run_scenario(
    scenario: Scenario, *, out_dir: str | Path, cache_dir: str | Path | None = None, use_cache: bool = True,
) -> ScenarioResult:
    """Runs ``scenario`` and writes ``OUT_DIR/report.{md,json}`` and ``progress.png``.

    Raises ``RuntimeError`` only when the fault-free reference itself fails
    (then no verdict about faults is possible); a faulted run that fails is a
    result with broken invariants.
    """
    out = Path(out_dir)
    plan = scenario.plan()
    ref = None
    if scenario.invariants.bitwise:
        ref = ensure_reference(scenario.job, Path(cache_dir) if cache_dir else default_cache_dir(),
                               timeout_s=scenario.timeout_s, use_cache=use_cache)
    run_dir = out / "run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run = run_job(scenario.job, run_dir, faults=plan, timeout_s=scenario.timeout_s)
    events = _events(run_dir)
    timelines = build_timelines(events, plan, run.driver_fired, run.launch_time)
    result = ScenarioResult(scenario=scenario, out_dir=out, plan=plan, run=run, reference=ref, timelines=timelines,
                            progress=progress(events, run.launch_time))
    if ref is not None:
        ref_events = _events(ref.path)
        result.reference_progress = progress(ref_events, ref_events[0]["time"] if ref_events else 0.0)
    result.checks = check_invariants(scenario.invariants, run, ref.final if ref else None, timelines,
                                     timeout_s=scenario.timeout_s)
    write_report(result)
    return result
