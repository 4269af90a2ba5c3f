"""Issue 30: what ordinary training loops do is not a fault, and a bug is found by its repetition.

Real jobs under the agent (2 ranks, CPU): the same exception after the commit every 20 steps stops the job
after one retry, naming it; a rank that leaves early with exit 0 is replaced, and stops the job as a bug
when its replacement leaves at the same step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import console_lines, run_script

SCRIPT = Path(__file__).resolve().parent / "ordinary_script.py"
STOPPED = 93


def _run(tmp_path: Path, mode: str, steps: int, timeout: float = 150):
    return run_script(tmp_path / mode, SCRIPT, [mode, str(steps)], nproc=2, timeout=timeout)


@pytest.mark.timeout(180)
def test_the_same_exception_after_the_commit_again_stops_the_job_after_one_retry(tmp_path):
    job = _run(tmp_path, "after-commit", 200)
    assert job.returncode == STOPPED, job.stderr[-3000:]
    # One recovery (the first ValueError, after step 19), then the second one (after step 39) is the bug.
    (stopped,) = job.of("job_stopped")
    assert stopped["rank"] == 0 and "ValueError" in stopped["reason"], stopped
    assert "raised again at step 39, as at step 19" in stopped["reason"], stopped["reason"]
    assert len([e for e in job.of("fault_detected") if e["source"] == "rank0"]) == 1
    # The traceback once, and the last line names the error and the rank.
    assert job.stderr.count("Traceback (most recent call last)") == 1, job.stderr[-3000:]
    last = console_lines(job.stderr)[-1]
    assert "rank 0" in last and "ValueError: metrics: cannot log step" in last and "exit code 93" in last, last


@pytest.mark.timeout(180)
def test_a_rank_that_leaves_early_with_exit_0_is_replaced_and_the_run_ends(tmp_path, ):
    job = _run(tmp_path, "exit0-once", 30)
    assert job.returncode == 0, job.stderr[-3000:]
    faults = [e for e in job.of("fault_detected") if e["source"] == "agent"]
    assert [(e["rank"], e["how"]) for e in faults] == [(1, "exit code 0")], faults
    assert [e["rank"] for e in job.of("worker_spawned") if e["replacement"]] == [1]
    assert job.of("final_state_written")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["exit0-always", "oexit0-always"])
def test_a_rank_that_leaves_early_at_the_same_step_again_is_a_bug(tmp_path, mode):
    job = _run(tmp_path, mode, 30, timeout=90)  # within 60 s of the first exit, by the test's own timeout
    assert job.returncode == STOPPED, job.stderr[-3000:]
    last = console_lines(job.stderr)[-1]
    assert "rank 1 left its training loop with exit code 0 at step 10, again" in last and "exit code 93" in last, last
    assert [e["rank"] for e in job.of("worker_spawned") if e["replacement"]] == [1]  # replaced once, not twice
    assert "timed out" not in job.stderr
