"""``run_scenario``: the fault-free reference, the faulted run, the invariants and the report."""

from __future__ import annotations

from pathlib import Path

from chaos.driver import run_job
from chaos.reference import default_cache_dir, ensure_reference
from chaos.report import write_report
from chaos.result import ScenarioResult
from chaos.scenario import Scenario
from chaos.timeline import build_timelines, progress
from chaos.verdict import check_invariants

__all__ = ["ScenarioResult", "run_scenario"]


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
