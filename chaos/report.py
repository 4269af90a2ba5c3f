"""``report.md``, ``report.json``, ``progress.png`` and ``report.html`` (the dashboard) of a scenario run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chaos.png import GREEN, ORANGE, RED, PlotUnavailable, progress_plot

if TYPE_CHECKING:
    from chaos.result import ScenarioResult

__all__ = ["write_report"]


def write_report(result: "ScenarioResult") -> None:
    out = result.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(_as_json(result), indent=2))
    marks = []
    for t in result.timelines:
        for v, colour in ((t.injected, RED), (t.detected, ORANGE), (t.recovered, GREEN)):
            if v is not None:
                marks.append((v, colour))
    plotted = True
    try:
        progress_plot(out / "progress.png", result.progress.steps, marks, total_s=max(result.run.wall_s, 1.0),
                      total_steps=result.scenario.job.steps)
    except PlotUnavailable as e:  # the verdict does not depend on a picture
        print(f"chaos report: no progress.png: {e}", file=sys.stderr)
        plotted = False
    dashboard = _dashboard(result)
    (out / "report.md").write_text(_markdown(result, plotted=plotted, dashboard=dashboard))


def _dashboard(r: "ScenarioResult") -> bool:
    """The run's dashboard as one self-contained page beside the report (no server needed to open it)."""
    from monitors.dashboard.export import export_html

    try:
        export_html(r.run.run_dir, r.out_dir / "report.html")
    except (OSError, ValueError) as e:
        print(f"chaos report: no report.html: {e}", file=sys.stderr)
        return False
    return True


def _as_json(r: "ScenarioResult") -> dict[str, Any]:
    return {
        "scenario": r.scenario.name,
        "ok": r.ok,
        "broken": r.broken(),
        "checks": [c.to_dict() for c in r.checks],
        "faults": [t.to_dict() for t in r.timelines],
        "goodput": r.progress.goodput,
        "reference_goodput": r.reference_progress.goodput if r.reference_progress else None,
        "productive_s": r.progress.productive_s,
        "window_s": r.progress.window_s,
        "wall_s": r.run.wall_s,
        "reference_wall_s": r.reference.wall_s if r.reference else None,
        "reference": str(r.reference.path) if r.reference else None,
        "reference_cached": r.reference.cached if r.reference else None,
        "run_dir": str(r.run.run_dir),
        "returncode": r.run.returncode,
        "timed_out": r.run.timed_out,
        "plan": [f.to_dict() for f in r.plan],
        "job": {"script": r.scenario.job.script, "argv": r.scenario.job.argv(), "ranks": r.scenario.job.ranks},
        "steps": r.progress.steps,
    }


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _markdown(r: "ScenarioResult", *, plotted: bool = True, dashboard: bool = True) -> str:
    verdict = "PASS" if r.ok else "FAIL (broken: " + ", ".join(r.broken()) + ")"
    ref = r.reference_progress
    lines = [
        f"# chaos scenario `{r.scenario.name}`: {verdict}",
        "",
        r.scenario.description.strip(),
        "",
        f"Job: `{' '.join(Path(a).name if i == 0 else a for i, a in enumerate(r.scenario.job.argv()))}` on "
        f"{r.scenario.job.ranks} ranks. Run directory: `{r.run.run_dir}`.",
        "",
        "## Invariants",
        "",
        "| invariant | holds | detail |",
        "| --- | --- | --- |",
        *(f"| {c.name} | {'yes' if c.ok else '**NO**'} | {c.detail.replace('|', '/')} |" for c in r.checks),
        "",
        "## Faults (seconds since launch)",
        "",
        "| # | fault | fired at step | injected | detected | by | recovered | detect s | recover s | steps redone |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {t.index} | {t.label} | {'-' if t.step is None else t.step} | {_fmt(t.injected)} | {_fmt(t.detected)} | "
            f"{t.detected_by or ('not required' if t.tolerated else '-')} | {_fmt(t.recovered)} | {_fmt(t.detect_s)} | "
            f"{_fmt(t.recover_s)} | {'-' if t.steps_redone is None else t.steps_redone} |"
            for t in r.timelines
        ),
        "",
        "## Goodput",
        "",
        f"Goodput (productive step time over wall time, first step to final state): **{r.progress.goodput:.1%}** "
        f"({r.progress.productive_s:.1f} s of {r.progress.window_s:.1f} s)"
        + (f"; fault-free reference: {ref.goodput:.1%} ({ref.productive_s:.1f} s of {ref.window_s:.1f} s)." if ref else "."),
        f"Wall time of the job, launch to exit: {r.run.wall_s:.1f} s"
        + (f" (reference {r.reference.wall_s:.1f} s)." if r.reference else "."),
        "",
        *(["![step progress](progress.png)", "",
           "Plot: steps of rank 0 (blue) over seconds since launch; per fault a red line when injected, "
           "orange when detected, green when every rank trained again. Grid: 10 s on x, a tenth of the steps on y.",
           ""] if plotted else ["(No step plot: matplotlib is not installed; `pip install 'resilient-train[chaos]'`.)", ""]),
        *(["## Dashboard", "",
           "[report.html](report.html): the run's dashboard in one file (opens with no server and no network): "
           "each fault's recovery split into detect, abort, rendezvous, heal and first step; straggler scores; "
           "checkpoints.", ""] if dashboard else []),
    ]
    return "\n".join(lines)
