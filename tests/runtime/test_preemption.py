"""Preemption: SIGTERM (or Slurm's SIGUSR1) stops every rank at one boundary, after a checkpoint; a restart loses no step."""

from __future__ import annotations

import os
import signal

import pytest

from jobs import Job, ckpt_diff, run_gpt, start_gpt, wait_for_event

STEPS = 30
REQUEUE = 75


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target, sig", [("agent", signal.SIGTERM),
                                         pytest.param("rank1", signal.SIGUSR1, marks=pytest.mark.slow)])
def test_preempted_job_checkpoints_exits_requeue_and_resumes_bitwise(tmp_path, references, target, sig):
    run_dir = tmp_path / "run"
    proc = start_gpt(run_dir, nproc=2, steps=STEPS)
    try:
        wait_for_event(run_dir, lambda e: e["event"] == "step_done" and e["step"] >= 8, timeout=120, proc=proc)
        if target == "agent":
            proc.send_signal(sig)
        else:
            rank1 = wait_for_event(run_dir, lambda e: e["event"] == "run_start" and e["rank"] == 1, timeout=10)
            os.kill(rank1["pid"], sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    first = Job(proc.returncode, stdout, stderr, run_dir)
    assert first.returncode == REQUEUE, first.stderr[-3000:]
    stopped = first.of("preempted")
    assert sorted(e["rank"] for e in stopped) == [0, 1]
    assert len({e["step"] for e in stopped}) == 1, "the ranks stopped at different boundaries"
    step = stopped[0]["step"]
    assert 8 <= step < STEPS and all(e["checkpoint_committed"] for e in stopped)
    assert f"every rank stopped at step {step}; its checkpoint is committed" in first.stderr

    # The same command again: it resumes from the preemption's checkpoint and ends where an uninterrupted run does.
    second = run_gpt(run_dir, nproc=2, steps=STEPS)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = [e for e in second.of("resumed_from_disk") if e["time"] > max(e["time"] for e in stopped)]
    assert {e["step"] for e in resumed} == {step}
    d = ckpt_diff(references.get(2, STEPS), run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr
