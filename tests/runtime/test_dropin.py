"""``resilient-train run`` as a drop-in for torchrun: unmodified scripts, torchrun's flags (issue 11)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from jobs import REPO, Job, cli, events_now, free_port

HERE = Path(__file__).resolve().parent / "dropin"
NANOGPT = HERE / "nanogpt_like.py"
LOOP = HERE / "allreduce_loop.py"
HEARTBEAT_LOOP = HERE / "heartbeat_loop.py"
CRASH = HERE / "crash_at_start.py"


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 150) -> Job:
    p = cli("run", "--run-dir", str(tmp_path / "run"), *args, env=env, timeout=timeout)
    return Job(p.returncode, p.stdout, p.stderr, tmp_path / "run")


def _out(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return out


def _monitor_config(tmp_path: Path, hang: dict) -> str:
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps({"hang": hang}))
    return str(path)


@pytest.mark.timeout(120)
def test_plain_loop_outlives_a_short_startup_timeout(tmp_path):
    # No progress reported: hang detection is off for the script, so a 6 s loop survives a 2 s startup timeout.
    out = _out(tmp_path)
    cfg = _monitor_config(tmp_path, {"startup_timeout_s": 2.0, "idle_timeout_s": 2.0})
    job = _run(tmp_path, "--nproc-per-node", "2", "--monitor-config", cfg, str(LOOP), str(out), "6")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "hang detection is off for allreduce_loop.py" in job.stderr
    assert len(job.of("worker_spawned")) == 2 and not job.of("restart_all") and not job.of("fault_detected")
    assert sorted(p.name for p in out.iterdir()) == ["rank0.attempt0", "rank1.attempt0"]


@pytest.mark.timeout(120)
def test_heartbeat_turns_hang_detection_on_and_the_kill_is_said(tmp_path):
    out = _out(tmp_path)
    cfg = _monitor_config(tmp_path, {"computed": False, "idle_timeout_s": 3.0})
    job = _run(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-config", cfg,
               str(HEARTBEAT_LOOP), str(out), "4", env={"HANG_RANK": "1"})
    assert job.returncode == 0, job.stderr[-3000:]
    assert "hang detection is off" not in job.stderr  # the script names resilient_train
    assert "killing rank 1: hung in between-steps at step 20" in job.stderr
    # Rank 0 waits on rank 1 in an all-reduce: seen from its heartbeats, it is as stuck, and is restarted too.
    assert "ranks 0, 1 hung (hung in between-steps at step 20" in job.stderr
    assert len(job.of("restart_all")) == 1
    assert sorted(p.name for p in out.iterdir()) == ["rank0.attempt1", "rank1.attempt1"]


def _kill_paused_rank(proc: subprocess.Popen, out: Path, run_dir: Path, rank: int, timeout: float = 90) -> int:
    """Waits until ``rank`` of the first attempt paused after its checkpoint, SIGKILLs it, returns its pid."""
    deadline = time.monotonic() + timeout
    while not (out / "paused").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the script never paused"
        time.sleep(0.05)
    pids = [e["pid"] for e in events_now(run_dir) if e.get("event") == "worker_spawned" and e.get("rank") == rank]
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


@pytest.mark.timeout(240)
def test_nanogpt_shaped_script_is_killed_restarts_and_resumes_from_its_checkpoint(tmp_path):
    # The same flags under torchrun, fault-free: the reference.
    ref = tmp_path / "ref"
    ref.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(NANOGPT), str(ref)], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-3000:]

    out = _out(tmp_path)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "resilient_train.cli", "run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "--run-dir", str(run_dir), str(NANOGPT), str(out)],
        cwd=REPO, env={**os.environ, "PAUSE_RANK": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _kill_paused_rank(proc, out, run_dir, rank=1)
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "resuming from iteration 10" in stdout
    assert "done at iteration 30, attempt 1" in stdout
    # Blame: the killed rank, not the survivor that lost its peer.
    assert "rank 1 failed first (signal SIGKILL)" in stderr, stderr[-3000:]
    assert "OMP_NUM_THREADS is set to 1" in stderr
    mine, theirs = torch.load(out / "final.pt"), torch.load(ref / "final.pt")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), "resumed run is not bitwise the fault-free one"


@pytest.mark.timeout(120)
def test_module_and_no_python_entries(tmp_path):
    out = _out(tmp_path)
    env = {"PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    job = _run(tmp_path, "--nproc-per-node", "2", "-m", "pkg.train", str(out), env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    assert sorted((out / f"rank{r}").read_text() for r in range(2)) == ["3.0 __main__ 1"] * 2

    wrapper = tmp_path / "train.sh"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m pkg.train \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    out2 = tmp_path / "out2"
    out2.mkdir()
    shutil.rmtree(tmp_path / "run")
    job = _run(tmp_path, "--nproc-per-node", "2", "--no-python", str(wrapper), str(out2), env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    assert sorted((out2 / f"rank{r}").read_text() for r in range(2)) == ["3.0 __main__ 1"] * 2


@pytest.mark.timeout(120)
def test_the_same_crash_twice_stops_after_two_attempts_with_one_traceback(tmp_path):
    job = _run(tmp_path, "--nproc-per-node", "2", "--max-restarts", "5", str(CRASH))
    assert job.returncode == 93, job.stderr[-3000:]
    assert job.stderr.count("Traceback (most recent call last)") == 1, job.stderr
    assert "the same traceback as rank" in job.stderr
    assert "KeyError: 'batch_size'" in job.stderr
    assert "the same failure as attempt 0 with no progress in between" in job.stderr
    assert [e["decision"] for e in job.of("attempt_failed")] == ["restart", "repeated"]


@pytest.mark.timeout(120)
def test_no_restart_by_default_as_torchrun(tmp_path):
    job = _run(tmp_path, "--nproc-per-node", "2", str(CRASH))
    assert job.returncode == 1, job.stderr[-3000:]
    assert "no restarts allowed (--max-restarts 0)" in job.stderr
    assert job.stderr.count("Traceback (most recent call last)") == 1, job.stderr


@pytest.mark.timeout(120)
def test_master_port_is_kept_across_restarts(tmp_path):
    out = _out(tmp_path)
    port = free_port()
    job = _run(tmp_path, "--nproc-per-node", "2", "--master-port", str(port), "--max-restarts", "1",
               str(LOOP), str(out), "2", env={"KILL_RANK": "0"})
    assert job.returncode == 0, job.stderr[-3000:]
    assert len(job.of("restart_all")) == 1
    ports = {(out / f"rank{r}.attempt1").read_text().split()[2] for r in range(2)}
    assert ports == {str(port)}
    assert {e["port"] for e in job.of("agent_start")} == {port}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "3:2"], "--nnodes 3:2: MIN is more than MAX"),
    (["--nnodes", "1:2:3"], "--nnodes '1:2:3': expected N or MIN:MAX"),
    (["--rdzv-backend", "etcd"], "--rdzv-backend etcd: only static or c10d"),
    (["--rdzv-conf", "bogus=1"], "--rdzv-conf: unknown key 'bogus'"),
    (["--nproc-per-node", "gpu"], "--nproc-per-node gpu: no GPU on this machine"),
    (["--logs-specs", "x"], "--logs-specs: log-spec plugins are not supported"),
    (["--redirects", "7"], "--redirects '7': expected 0-3"),
    (["--local-ranks-filter", "5"], "--local-ranks-filter: local rank 5 is not in [0, 1)"),
    (["-m", "--no-python"], "-m and --no-python exclude each other"),
])
def test_refused_torchrun_flags_are_one_line(tmp_path, flags, message):
    if flags == ["--nproc-per-node", "gpu"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = cli("run", "--run-dir", str(tmp_path / "run"), *flags, str(CRASH))
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"resilient-train: error: {message}"] or message in p.stderr.strip(), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.timeout(120)
def test_log_dir_tee_and_ranks_filter(tmp_path):
    out = _out(tmp_path)
    logs = tmp_path / "logs"
    job = _run(tmp_path, "--nproc-per-node", "2", "--log-dir", str(logs), "--tee", "3", "--local-ranks-filter", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "job42",
               str(NANOGPT), str(out))
    assert job.returncode == 0, job.stderr[-3000:]
    assert (logs / "attempt_0" / "0" / "stdout.log").read_text().startswith("done at iteration 30")
    assert (logs / "attempt_0" / "1" / "stdout.log").exists()
    assert "[default0]:done at iteration 30" in job.stdout + job.stderr
    assert "[default1]" not in job.stdout + job.stderr


@pytest.mark.timeout(90)
def test_status_of_a_finished_plain_run(tmp_path):
    out = _out(tmp_path)
    job = _run(tmp_path, "--nproc-per-node", "2", str(LOOP), str(out), "1")
    assert job.returncode == 0, job.stderr[-3000:]
    p = cli("status", str(job.run_dir))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == f"run {job.run_dir}: finished"
