"""The store host raises its open-file limit; its workers and spares keep the one it was started with.

A rank holds up to four connections to node 0's store, all served by the agent's process: at 4,096 ranks,
past the usual soft limit of 1,024 (resilient_train.agent.fdlimit). Real processes: the agent of a GPT job, its
ranks and its warm spare, their limits read from /proc.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import REPO, events_now, start_gpt, wait_for_event

LOW = 512


def _nofile(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-file limit for pid {pid}")


@pytest.mark.timeout(180)
def test_the_store_host_raises_its_limit_and_its_children_keep_the_original(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= LOW:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to raise")
    run_dir = tmp_path / "run"
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, hard))  # the agent starts with it (and restores ours after)
    try:
        proc = start_gpt(run_dir, nproc=2, steps=400)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        wait_for_event(run_dir, lambda e: e["event"] == "step_done" and e["step"] >= 2, timeout=120, proc=proc)
        spare = wait_for_event(run_dir, lambda e: e["event"] == "spare_ready", timeout=120, proc=proc)
        agent_soft, agent_hard = _nofile(proc.pid)
        assert agent_soft > LOW and agent_soft == agent_hard, (agent_soft, agent_hard)
        ranks = [e["pid"] for e in events_now(run_dir) if e["event"] == "worker_spawned"]
        assert len(ranks) == 2
        for pid in [*ranks, spare["pid"]]:
            assert _nofile(pid)[0] == LOW, pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    assert "open files" not in stderr  # 2 ranks: the raised limit is plenty, nothing to say


@pytest.mark.timeout(60)
def test_a_hard_limit_short_of_the_job_is_said_in_one_line():
    """400 ranks need 1,856 descriptors at the store host; a hard limit of 1,000 cannot be raised past."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (300, 1000)); "
            "from resilient_train.agent import fdlimit; print(fdlimit.raise_for_store(400)); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0]); print(fdlimit.raise_for_store(8))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=REPO)
    assert out.returncode == 0, out.stderr
    warning, raised, enough = out.stdout.splitlines()
    assert warning.startswith("warning: the store host may hold 1856 open files (4 connections per rank for 400 ranks)")
    assert "its limit is 1000" in warning and "ulimit -n 1856" in warning
    assert raised == "1000" and enough == "None"
