"""The supervisor under plain torchrun, with no resilient-train agent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from jobs import GPT, REPO, SMALL_GPT, Job, ckpt_diff, survivors_kept_pids

STEPS = 16
TORCHRUN = shutil.which("torchrun")


def _torchrun(run_dir, faults, *, max_restarts: int, extra: list[str] | None = None) -> Job:
    env = {
        **os.environ,
        "RT_RUN_DIR": str(run_dir),
        "RT_CHAOS": json.dumps(faults),
        # torchrun's shared store keeps stale gloo addresses across restarts.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
           "--standalone", str(GPT), "--steps", str(STEPS), *SMALL_GPT, *(extra or [])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=REPO, env=env)
    return Job(p.returncode, p.stdout, p.stderr, run_dir)


@pytest.mark.timeout(240)
def test_exception_recovers_in_process_under_torchrun(tmp_path, references):
    job = _torchrun(tmp_path / "run", [{"kind": "raise", "rank": 1, "step": 4, "phase": "backward"}], max_restarts=0)
    assert job.returncode == 0, job.stderr[-3000:]
    assert len(job.of("recovery_done")) == 2
    survivors_kept_pids(job, killed=set())
    d = ckpt_diff(references.get(2, STEPS), job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.slow  # torchrun's own restart of every worker: 40 s of CI for torchrun's behaviour, not ours
@pytest.mark.timeout(240)
def test_dead_process_is_restarted_by_torchrun(tmp_path, references):
    job = _torchrun(tmp_path / "run", [{"kind": "kill", "rank": 1, "step": 4, "phase": "forward"}], max_restarts=1)
    assert job.returncode == 0, job.stderr[-3000:]
    # torchrun restarted both workers: two run starts per rank.
    assert sorted(e["rank"] for e in job.of("run_start")) == [0, 0, 1, 1]
    # The survivor waited in a join for the dead rank when torchrun's SIGTERM came: it stopped the job from
    # there (Preemption.overdue_in_join) rather than sit out torchrun's 30 s to its SIGKILL.
    first_end = [e for e in job.of("run_end") if e["rank"] == 0][0]
    assert "preempted (SIGTERM) while it recovered from a failure" in first_end.get("stopped", ""), first_end
    d = ckpt_diff(references.get(2, STEPS), job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(240)
def test_torchrun_restart_resumes_from_the_newest_checkpoint(tmp_path, references):
    steps = STEPS
    faults = [{"kind": "kill", "rank": 0, "step": 14, "phase": "backward"}]
    job = _torchrun(tmp_path / "run", faults, max_restarts=1,
                    extra=["--steps", str(steps), "--ckpt-every", "4", "--ckpt-mode", "disabled"])
    assert job.returncode == 0, job.stderr[-3000:]
    resumed = job.of("resumed_from_disk")
    assert sorted(e["rank"] for e in resumed) == [0, 1]
    assert {e["step"] for e in resumed} == {12}
    d = ckpt_diff(references.get(2, steps), job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr
