"""Unmodified torchrun scripts under ``resilient-train run``."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import Job, cli

SCRIPT = Path(__file__).resolve().parent / "plain_torchrun_script.py"


def _run(tmp_path, *, kill_rank: str = "") -> tuple[Job, Path]:
    out = tmp_path / "out"
    out.mkdir()
    p = cli("run", "--nproc-per-node", "3", "--run-dir", str(tmp_path / "run"), "--no-spare", "--max-restarts", "1",
            str(SCRIPT), str(out), env={"KILL_RANK": kill_rank}, timeout=120)
    return Job(p.returncode, p.stdout, p.stderr, tmp_path / "run"), out


@pytest.mark.timeout(150)
def test_env_init_and_all_reduce(tmp_path):
    job, out = _run(tmp_path)
    assert job.returncode == 0, job.stderr[-2000:]
    results = sorted((out / f"rank{r}").read_text() for r in range(3))
    assert results == [f"6.0 3 {r} 0" for r in range(3)]


@pytest.mark.timeout(150)
def test_dead_rank_restarts_every_worker(tmp_path):
    job, out = _run(tmp_path, kill_rank="1")
    assert job.returncode == 0, job.stderr[-2000:]
    assert len(job.of("restart_all")) == 1
    # Every rank finished in the second attempt, on a fresh store.
    assert sorted((out / f"rank{r}").read_text() for r in range(3)) == [f"6.0 3 {r} 1" for r in range(3)]
