"""Preemption: SIGTERM (or Slurm's SIGUSR1) stops every rank at one boundary, after a checkpoint; a restart loses no step."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from jobs import Job, ckpt_diff, events_now, run_gpt, start_gpt, wait_for_event

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


SLOW = "RESILIENT_TRAIN_CKPT_SLOW_WRITE"  # checkpointing.testhooks: the writer sleeps before a step's save
OLD_TIMEOUT = ["--shutdown-timeout", "3"]  # torchrun's kill, scaled down: it cut the save in flight short (143)
STEPS4 = 24  # the 4-rank reference test_nodes.py uses too


def _preempted_job(run_dir, *, nproc: int, steps: int, extra: list[str], env: dict[str, str],
                   agent_args: list[str], after, script=None, before=None) -> tuple[Job, float]:
    """Starts a GPT job, SIGTERMs its agent once ``after(event)`` holds (``before()`` first, if given); the job
    and the signal's wall time."""
    import time

    kw = {"script": script} if script is not None else {}
    proc = start_gpt(run_dir, nproc=nproc, steps=steps, extra=extra, env=env, agent_args=agent_args, **kw)
    try:
        wait_for_event(run_dir, after, timeout=150, proc=proc)
        if before is not None:
            before()
        signalled = time.time()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Job(proc.returncode, stdout, stderr, run_dir), signalled


@pytest.mark.timeout(600)
def test_a_save_in_flight_longer_than_the_old_timeout_still_ends_in_75_and_resumes_on_4_and_2_ranks(
        tmp_path, references):
    """4 ranks, a checkpoint every 5 steps; step 5's save is slowed to 8 s in the writer, and the agent is
    SIGTERMed while it is in flight, with a 3 s --shutdown-timeout (the old kill, scaled down from 30 s).
    The ranks wait for that save, write the preemption's and exit 75 within their grace, which the agent
    follows: it exits 75, with one "preempted" line. The same command resumes, loses no step and ends
    bitwise; on 2 ranks the 4-rank checkpoint loads as docs/sharded.md says (the model and optimizer as saved,
    rank r the local state rank r saved)."""
    run_dir = tmp_path / "run"
    extra, env = ["--ckpt-every", "5"], {SLOW: "8@5"}
    first, signalled = _preempted_job(
        run_dir, nproc=4, steps=STEPS4, extra=extra, env=env, agent_args=OLD_TIMEOUT,
        after=lambda e: e["event"] == "checkpoint_staged" and e["step"] == 5 and e["rank"] == 0)
    assert first.returncode == REQUEUE, first.stderr[-3000:]
    stopped = first.of("preempted")
    assert sorted(e["rank"] for e in stopped) == [0, 1, 2, 3] and all(e["checkpoint_committed"] for e in stopped)
    (step,) = {e["step"] for e in stopped}
    # The stop met the save of step 5 in flight, which committed more than the old timeout after the signal
    # (8 s after its write began, which was before the signal: the margin is for this test's own delays).
    assert {e["in_flight"] for e in first.of("checkpoint_waiting")} == {5}
    (five,) = [e for e in first.of("checkpoint_committed") if e["step"] == 5 and e["rank"] == 0]
    assert five["time"] - signalled > 3
    assert not first.of("shutdown_killed")
    said = [line for line in first.stderr.splitlines() if "preempted" in line]
    assert len(said) == 1 and f"every rank stopped at step {step}; its checkpoint is committed" in said[0], said
    (end,) = first.of("agent_end")
    assert (end["exit_code"], end["step"], end["checkpoint_committed"]) == (REQUEUE, step, True)

    two = tmp_path / "two"
    two.mkdir()
    shutil.copytree(run_dir / "checkpoints", two / "checkpoints")

    # The same command again: it resumes from the preemption's checkpoint and ends where an uninterrupted run does.
    second = run_gpt(run_dir, nproc=4, steps=STEPS4, extra=extra, env=env, agent_args=OLD_TIMEOUT, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = [e for e in second.of("resumed_from_disk") if e["time"] > signalled]
    assert sorted(e["rank"] for e in resumed) == [0, 1, 2, 3] and {e["step"] for e in resumed} == {step}
    d = ckpt_diff(references.get(4, STEPS4), run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr

    # On 2 ranks, to the same step: the state they hold is the checkpoint's.
    job = run_gpt(two, nproc=2, steps=step, extra=extra)
    assert job.returncode == 0, job.stderr[-3000:]
    assert sorted((e["rank"], e["step"]) for e in job.of("resumed_from_disk")) == [(0, step), (1, step)]
    import torch

    from checkpointing import diff_states, read_state

    saved, _ = read_state(two / "checkpoints" / f"step-{step}")
    final, _ = read_state(two / "final")
    for part in ("model", "optimizer"):
        assert diff_states(saved[part], final[part]) is None, (part, diff_states(saved[part], final[part]))
    for r in (0, 1):  # the data position and the RNG stream (the final state names unused streams "unused")
        mine, theirs = final["ranks"][str(r)], saved["__ranks__"][r]["local"]
        assert mine["step"] == theirs["step"] == step and torch.equal(mine["rng"]["torch"], theirs["rng"]["torch"])


@pytest.mark.timeout(300)
def test_ranks_killed_after_their_commit_still_end_in_75(tmp_path):
    """Both ranks hang in their teardown after the preemption's checkpoint committed, ignoring SIGTERM: the
    agent SIGKILLs them at the end of their grace (8 s) and exits 75 all the same (the commit is in the store),
    where it used to say 143 (no worker had exited 75)."""
    run_dir = tmp_path / "run"
    script = Path(__file__).resolve().parent / "hang_after_preempt.py"
    # A checkpoint at step 20 first: the writer is up (and the run far from its end), so the preemption's save
    # takes a moment, not the writer's start.
    job, _ = _preempted_job(run_dir, nproc=2, steps=5000, extra=["--preempt-grace", "8", "--ckpt-every", "20"],
                            env={}, agent_args=[], script=script,
                            after=lambda e: e["event"] == "checkpoint_committed" and e["step"] == 20 and e["rank"] == 0)
    assert job.returncode == REQUEUE, job.stderr[-3000:]
    assert all(e["checkpoint_committed"] for e in job.of("preempted")) and len(job.of("preempted")) == 2
    (killed,) = job.of("shutdown_killed")
    assert killed["ranks"] == [0, 1] and killed["grace_s"] == 8
    assert "its checkpoint is committed" in job.stderr and "SIGKILL after 8 s" in job.stderr


@pytest.mark.timeout(300)
def test_sigterm_to_the_agent_right_after_a_rank_is_killed_ends_in_75_and_resumes_bitwise(tmp_path, references):
    """An operator's two faults at once: a rank SIGKILLed from outside and, in the same instant, the scheduler's
    SIGTERM to the agent. Whichever way the race goes (the replacement joins and the stop rides the next vote,
    with the preemption's checkpoint; or the survivor waits in a join nobody will finish and stops the job
    from there), the agent exits 75 well inside the grace, and the same command resumes and ends bitwise where
    an uninterrupted run does."""
    run_dir = tmp_path / "run"
    extra = ["--ckpt-every", "5"]

    def kill_rank1() -> None:
        rank1 = [e for e in events_now(run_dir) if e["event"] == "run_start" and e["rank"] == 1][-1]
        os.kill(rank1["pid"], signal.SIGKILL)

    first, signalled = _preempted_job(run_dir, nproc=2, steps=STEPS, extra=extra, env={}, agent_args=[],
                                      after=lambda e: e["event"] == "step_done" and e["step"] >= 8, before=kill_rank1)
    assert first.returncode == REQUEUE, first.stderr[-3000:]
    (end,) = first.of("agent_end")
    took = end["time"] - signalled
    assert took < 60, f"the agent left {took:.0f} s after the signal: at its grace's SIGKILL, not by the ranks"
    committed = [e for e in first.of("preempted") if e.get("checkpoint_committed")]
    stops = [e for e in first.of("job_stopped") if "preempted (SIGTERM) while" in e["reason"]]
    assert len(committed) == 2 or (stops and stops[0]["exit_code"] == REQUEUE), (first.of("preempted"), stops)

    second = run_gpt(run_dir, nproc=2, steps=STEPS, extra=extra)
    assert second.returncode == 0, second.stderr[-3000:]
    d = ckpt_diff(references.get(2, STEPS), run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr
