"""Nobody else can steer a job, no livelock, no hang slips through (issue 17, items 1 to 3)."""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from jobs import ckpt_diff, run_gpt, start_gpt, wait_for_event

STEPS = 40


def _listening(pids: set[int]) -> list[str]:
    """The addresses the given processes listen on (TCP, IPv4 and IPv6), from /proc."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in inodes:  # LISTEN
                found.append(local.split(":")[0])
    return found


def _is_loopback(hex_addr: str) -> bool:
    if len(hex_addr) == 8:  # IPv4, little-endian
        return hex_addr.endswith("7F")
    return hex_addr in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


@pytest.mark.timeout(300)
def test_a_stranger_writing_to_the_store_changes_nothing(tmp_path, references):
    run = tmp_path / "run"
    proc = start_gpt(run, nproc=2, steps=STEPS)
    try:
        start = wait_for_event(run, lambda e: e["event"] == "agent_start", timeout=60, proc=proc)
        wait_for_event(run, lambda e: e["event"] == "step_done" and e["step"] >= 2, timeout=120, proc=proc)
        # Everything the job's processes listen on is loopback.
        pids = {proc.pid} | {e["pid"] for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                             if e["event"] == "worker_spawned"}
        listening = _listening(pids)
        assert listening and all(_is_loopback(a) for a in listening), listening
        # A stranger who knows the port (from agent_start) but not the job's token.
        stranger = dist.TCPStore("127.0.0.1", start["port"], is_master=False, timeout=timedelta(seconds=10))
        for prefix in ("", "attempt/0/", "/worker/attempt_0/"):
            stranger.set(prefix + "rt/final", "0")
            stranger.set(prefix + "rt/stop", json.dumps({"rank": 0, "summary": "forged", "exit_code": 0}))
            for g in range(4):
                stranger.set(prefix + f"rt/fault/{g}", json.dumps({"rank": 0, "kind": "forged"}))
            stranger.set(prefix + "rt/generation", "7")
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "fault_detected"], "a forged key was taken for a fault"
    assert max(e["step"] for e in events if e["event"] == "step_done") == STEPS
    d = ckpt_diff(references.get(2, STEPS), run / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.slow  # 50 s in CI
@pytest.mark.timeout(300)
def test_a_replacement_killed_while_the_group_is_built_does_not_livelock(tmp_path, references):
    """SIGKILL rank 1; once every rank has joined the next generation, SIGKILL the replacement (issue 17)."""
    faults = [{"kind": "kill", "rank": 1, "step": 5, "phase": "forward"},
              {"kind": "kill", "rank": 1, "step": 5, "phase": "rendezvous"}]
    job = run_gpt(tmp_path / "run", nproc=3, steps=12, faults=faults, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert [e["phase"] for e in job.of("fault_injected")] == ["forward", "rendezvous"]
    done = job.of("recovery_done")
    assert done and max(e["generation"] for e in done) <= 4, [e["generation"] for e in done]
    d = ckpt_diff(references.get(3, 12), job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(300)
def test_a_rank_stopped_between_steps_is_caught_with_checkpoints_on(tmp_path, references):
    faults = [{"kind": "hang", "rank": 1, "step": 6, "phase": "between-steps"}]
    job = run_gpt(tmp_path / "run", nproc=3, steps=12, faults=faults, extra=["--ckpt-every", "10"], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    (hang,) = [e for e in job.of("hang_detected") if e["rank"] == 1]
    # Stopped as it left the optimizer for the step boundary: not taken for a checkpoint (600 s timeout).
    assert hang["section"] in ("optimizer", "between-steps") and hang["step"] == 6, hang
    assert hang["since_progress_s"] <= hang["timeout_s"] + 2.0, hang
    d = ckpt_diff(references.get(3, 12), job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr
