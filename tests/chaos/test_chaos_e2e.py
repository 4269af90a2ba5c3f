"""Issue 6 acceptance: real jobs under the agent, real signals, compared bit for bit with fault-free runs.

* the quick matrix: 2 ranks, a short job, every fault kind the runtime survives, all passing;
* the shortened soak: 4 ranks, random faults from a fixed seed, bitwise equal;
* a scenario that cannot hold (every rank killed at once, no checkpoints) fails, names the
  broken invariants, and ends.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.cli import LIBRARY
from chaos.matrix import UNSUPPORTED, MatrixConfig, run_matrix
from chaos.schedule import all_kinds
from chaos.testing import chaos_reference_cache, chaos_run  # noqa: F401  (fixtures)
from monitors.events import read_events

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 59 s in CI; the soak-short run below stays in the quick set
@pytest.mark.timeout(420)
def test_quick_matrix_every_fault_kind_passes(tmp_path: Path, chaos_reference_cache: Path) -> None:  # noqa: F811
    result = run_matrix(MatrixConfig(quick=True), out_dir=tmp_path / "matrix", cache_dir=chaos_reference_cache, echo=False)
    covered = {kind for kind, _ in result.cells}
    assert covered == set(all_kinds()) - set(UNSUPPORTED)
    failed = {f"{k}@{p}": why for (k, p), (ok, why) in result.cells.items() if not ok}
    assert not failed, f"{failed}\n{result.table()}\nreports: {tmp_path / 'matrix'}"
    for job in result.jobs:
        assert (job.out_dir / "report.md").is_file() and (job.out_dir / "progress.png").is_file()


@pytest.mark.timeout(480)
def test_soak_short_random_faults_bitwise(chaos_run) -> None:  # noqa: F811
    result = chaos_run(LIBRARY / "soak-short.yaml")
    assert sum(t.injected is not None for t in result.timelines) >= 8
    assert {c.name for c in result.checks} >= {"completes", "bitwise", "detected", "recovered", "min_faults"}
    # The report's dashboard (one self-contained file) shows every planted fault, on one incident each.
    page = (result.out_dir / "report.html").read_text()
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', page)
    data = json.loads(re.search(r'<script id="rt-data" type="application/json">(.*?)</script>', page, re.S)
                      .group(1).replace("<\\/", "</"))
    shown = sorted((f["kind"], f["rank"], f["step"]) for i in data["incidents"] for f in i["injected"])
    planted = sorted((e["kind"], e["rank"], e["step"]) for e in read_events(result.run.run_dir)
                     if e["event"] == "fault_injected")
    assert shown == planted and len(planted) >= 8
    assert "[report.html](report.html)" in (result.out_dir / "report.md").read_text()


@pytest.mark.timeout(300)
def test_scenario_that_cannot_hold_fails_and_names_the_invariant(tmp_path: Path, chaos_reference_cache: Path) -> None:  # noqa: F811
    out = tmp_path / "kill-all"
    p = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli", "chaos", "run", "kill-all-no-ckpt", "--out", str(out),
         "--cache-dir", str(chaos_reference_cache)],
        capture_output=True, text=True, cwd=REPO, timeout=280,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    report = json.loads((out / "report.json").read_text())
    assert not report["ok"] and not report["timed_out"]
    assert {"completes", "bitwise", "recovered"} <= set(report["broken"]), report["broken"]
    assert "completes" in p.stdout and "FAIL" in p.stdout
    md = (out / "report.md").read_text()
    assert "FAIL (broken: completes" in md and "| completes | **NO** |" in md


@pytest.mark.timeout(60)
def test_cli_bad_scenario_file_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("job: {script: nowhere.py}\nschedule: {faults: []}\n")
    p = subprocess.run([sys.executable, "-m", "resilient_train.cli", "chaos", "run", str(bad)],
                       capture_output=True, text=True, cwd=REPO, timeout=50)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "job.script" in p.stderr and "bad.yaml" in p.stderr
