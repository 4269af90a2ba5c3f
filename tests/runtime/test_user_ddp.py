"""A DDP the script builds itself in ``on_new_group`` (the README's pattern), through a SIGKILL from outside.

Issue 22: 3 ranks, a worker killed with ``kill -9`` while a survivor's
all-reduce was still pending in gloo's worker thread; the generation
recovered, then the survivor froze for good in its ``on_new_group`` (the old
DDP held the failed group's last reference: its destructor joined gloo's
threads on the main thread, with the GIL that the pending collective's
callback needed), and the two others were killed 3 s later as "hung in
all-reduce" (``waiting_on: []``: the frozen one showed "recovery", read as
gone on to the next generation). ``user_ddp_script.py`` sets that moment up
with files; the kill is a real SIGKILL from this test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import REPO, Job, ckpt_diff, run_script, survivors_kept_pids, wait_for_event

from monitors.progressreader import ProgressReader

SCRIPT = Path(__file__).resolve().parent / "user_ddp_script.py"
STEPS, AT = 14, 6


@pytest.mark.timeout(300)
def test_a_user_ddp_recovers_bitwise_from_a_kill_during_a_survivors_pending_all_reduce(tmp_path):
    barrier, run_dir = tmp_path / "barrier", tmp_path / "run"
    barrier.mkdir()
    out, err = (tmp_path / "stdout").open("w"), (tmp_path / "stderr").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "3", "--run-dir", str(run_dir),
         str(SCRIPT), "--steps", str(STEPS), "--reproducible", "--barrier", str(barrier), "--fault-step", str(AT)],
        cwd=REPO, stdout=out, stderr=err, start_new_session=True)
    try:
        victim = wait_for_event(run_dir, lambda e: e["event"] == "run_start" and e["rank"] == 2, timeout=120,
                                proc=proc)["pid"]
        # The moment: ranks 1 and 2 wait in step AT's data phase; rank 0's all-reduce is out and pending.
        reader = ProgressReader(run_dir, 0)
        deadline = time.monotonic() + 120
        while not ((barrier / "waiting-1").exists() and (barrier / "waiting-2").exists()
                   and (s := reader.read()) is not None and (s.section, s.step) == ("all-reduce", AT)):
            assert time.monotonic() < deadline and proc.poll() is None, "the job never reached the moment"
            time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()
        err.close()
    job = Job(proc.returncode, (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text(), run_dir)
    assert job.returncode == 0, job.stderr[-3000:]
    assert (barrier / "dropped-0").exists()  # the ordering the script sets up took place
    # One fault, the kill: no rank was taken for hung while its peers recovered.
    agent = [e for e in job.of("fault_detected") if e["source"] == "agent"]
    assert [(e["rank"], e["kind"]) for e in agent] == [(2, "exit")], agent
    assert not [h for h in job.of("hang_detected") if not h["waiting"]], job.of("hang_detected")
    survivors_kept_pids(job, killed={2})
    ref = run_script(tmp_path / "ref", SCRIPT, ["--steps", str(STEPS), "--reproducible"], nproc=3, timeout=200)
    assert ref.returncode == 0, ref.stderr[-3000:]
    d = ckpt_diff(ref.run_dir / "final", job.run_dir / "final")
    assert d.returncode == 0, f"final state differs from the fault-free run: {d.stdout}{d.stderr}"
