"""Every way of stopping a job is clean: one line says what happened, agent_end is written, no process is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import REPO, Job, events_now, start_gpt, wait_for_event

LOOP = Path(__file__).resolve().parent / "dropin" / "allreduce_loop.py"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _worker_pids(run_dir: Path) -> list[int]:
    return [e["pid"] for e in events_now(run_dir) if e.get("event") == "worker_spawned"]


def _finish(proc: subprocess.Popen, run_dir: Path) -> Job:
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Job(proc.returncode, out, err, run_dir)


@pytest.mark.timeout(150)
def test_ctrl_c_on_a_plain_script_is_one_line_per_rank_and_leaves_nothing(tmp_path):
    out, run_dir, log = tmp_path / "out", tmp_path / "run", tmp_path / "steps"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "2",
                             "--run-dir", str(run_dir), str(LOOP), str(out), "60"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "STEP_LOG": str(log)})
    deadline = time.monotonic() + 60
    while not (log.exists() and len(log.read_text().splitlines()) >= 5):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    job = _finish(proc, run_dir)
    assert job.returncode == 128 + signal.SIGINT, job.stderr[-3000:]
    assert "Traceback" not in job.stderr, job.stderr
    assert "received SIGINT: forwarding it to the workers" in job.stderr
    (end,) = job.of("agent_end")
    assert end["reason"] == "received SIGINT" and end["exit_code"] == 130
    assert not [pid for pid in _worker_pids(run_dir) if _alive(pid)]


@pytest.mark.timeout(200)
def test_ctrl_c_on_a_supervisor_job_checkpoints_and_stops(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_gpt(run_dir, nproc=2, steps=200)
    wait_for_event(run_dir, lambda e: e["event"] == "step_done" and e["step"] >= 5, timeout=120, proc=proc)
    os.killpg(proc.pid, signal.SIGINT)
    job = _finish(proc, run_dir)
    assert job.returncode == 75, job.stderr[-3000:]
    assert "Traceback" not in job.stderr, job.stderr
    assert "its checkpoint is committed" in job.stderr
    assert len(job.of("agent_end")) == 1
    assert not [pid for pid in _worker_pids(run_dir) if _alive(pid)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_chaos_run_takes_its_job_down(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.Popen([sys.executable, "-m", "resilient_train.cli", "chaos", "run", "kill", "--out", str(out),
                             "--no-cache"], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        runs: list[Path] = []
        while not runs:  # a job under test is running (the reference or the faulted one)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            runs = [p.parent for p in out.rglob("events.jsonl")
                    if any(e.get("event") == "worker_spawned" for e in events_now(p.parent))]
            time.sleep(0.1)
        pids = _worker_pids(runs[0])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "received SIGTERM: the job under test was stopped" in err
    deadline = time.monotonic() + 10
    while [pid for pid in pids if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "the job outlived chaos run"
