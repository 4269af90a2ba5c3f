"""Issue 30: a healthy job is never killed. An evaluation inside the step (on every rank, or on rank 0 alone
while the others wait for it), and a pause of the whole job (SIGSTOP to its process group, then SIGCONT, as
Ctrl-Z and ``fg``, ``scontrol suspend``/``resume`` or a frozen VM do) kill no rank, and the run ends bit for bit
where the same run without them ends. Default hang settings throughout: that is the point."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from jobs import SMALL_GPT, ckpt_diff, run_script, start_gpt, wait_for_event

EVAL_SCRIPT = Path(__file__).resolve().parent / "eval_script.py"
STEPS = 220


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank", [None, 0], ids=["every-rank", "rank-0-alone"])
def test_an_evaluation_inside_the_step_kills_no_rank_and_the_run_is_bitwise(tmp_path, references, rank):
    """8 s of evaluation at steps 100 and 200, after fast steps: the old detector's 3 s floor killed the ranks
    at the first one (every rank), or rank 0 at each one until the replacement budget was spent (rank 0
    alone)."""
    env = {"EVAL_EVERY": "100", "EVAL_S": "8"} | ({"EVAL_RANK": str(rank)} if rank is not None else {})
    job = run_script(tmp_path / "run", EVAL_SCRIPT, ["--steps", str(STEPS), *SMALL_GPT], nproc=2, env=env,
                     timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    # Both ranks write to the agent's own stdout: their lines may interleave, so count the phrase itself.
    assert job.stdout.count("eval at step") == (2 if rank is not None else 4), job.stdout[-2000:]
    assert not job.of("hang_detected") and not job.of("fault_detected"), (job.of("hang_detected"),
                                                                            job.of("fault_detected"))
    assert not [e for e in job.of("worker_spawned") if e["replacement"]]
    d = ckpt_diff(references.get(2, STEPS), job.run_dir / "final")
    assert d.returncode == 0, f"final state differs from the run without evaluations: {d.stdout}{d.stderr}"


@pytest.mark.timeout(300)
def test_the_whole_job_stopped_for_10_s_and_continued_kills_no_rank(tmp_path, references):
    steps = 400
    proc = start_gpt(tmp_path / "run", nproc=2, steps=steps)
    try:
        wait_for_event(tmp_path / "run", lambda e: e["event"] == "step_done" and e["step"] >= 50, timeout=120,
                       proc=proc)
        pgid = os.getpgid(proc.pid)  # the agent's session: the agent, its ranks, their writers and spares
        os.killpg(pgid, signal.SIGSTOP)
        time.sleep(10.0)  # the pause itself (the fault's duration), not a wait for anything
        os.killpg(pgid, signal.SIGCONT)
        out, err = proc.communicate(timeout=200)
    except BaseException:
        proc.kill()
        raise
    finally:
        if proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    from jobs import Job

    job = Job(proc.returncode, out, err, tmp_path / "run")
    assert not job.of("hang_detected") and not job.of("fault_detected"), (job.of("hang_detected"),
                                                                            job.of("fault_detected"))
    paused = job.of("agent_paused")
    assert paused and max(e["seconds"] for e in paused) >= 9.0, paused  # the agent saw its own clock jump
    d = ckpt_diff(references.get(2, steps), job.run_dir / "final")
    assert d.returncode == 0, f"final state differs from the undisturbed run: {d.stdout}{d.stderr}"
