"""A scenario's result: the plan, the faulted run, the reference, the invariants checked, the timelines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from chaos.driver import JobRun
from chaos.reference import Reference
from chaos.scenario import Scenario
from chaos.schedule import PlannedFault
from chaos.timeline import FaultTimeline, Progress, progress
from chaos.verdict import Check

__all__ = ["ScenarioResult"]


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
