"""Nobody else can steer a job, no livelock, no hang slips through (issue 17, items 1 to 3)."""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from jobs import REPO, ckpt_diff, events_now, free_port, run_gpt, start_gpt, wait_for_event

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
        pids = {proc.pid} | {e["pid"] for e in events_now(run) if e["event"] == "worker_spawned"}
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
    # The survivors may be building the group the replacement was killed before joining, waiting for its
    # address: the wake ends that wait (resilient_train.rank.cancelstore), never the group's 30 s store timeout.
    (killed_at,) = [e["time"] for e in job.of("fault_injected") if e["phase"] == "rendezvous"]
    later = [e for e in job.of("fault_detected") if e["rank"] in (0, 2) and e["time"] >= killed_at]
    assert not any("wait timeout" in e.get("error", "") for e in later), later  # tests/runtime/test_cancelstore.py
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


HOLD = Path(__file__).resolve().parent / "hold_script.py"  # prints "ready", then waits for a line on stdin
NOBODY = 65534


def _as_another_user(probe, *args) -> dict:
    """``probe(*args)`` in a forked child that became uid/gid 65534 (``nobody``): its JSON-able result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = json.dumps({"uid": os.getuid(), **probe(*args)}).encode()
        except BaseException as e:  # noqa: BLE001 (reported to the parent, which fails the test)
            out, code = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode(), 1
        os.write(w, out)
        os._exit(code)
    os.close(w)
    chunks = []
    while True:
        ready, _, _ = select.select([r], [], [], 60)
        assert ready, "the other user's probe did not answer within 60 s"
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


def _keys_under(port: int, prefixes: list[str]) -> list[str]:
    """The prefixes under which the job's generation key exists in the store on ``port``."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return [p for p in prefixes if store.check([f"job-{p}/attempt/0/rt/generation"])]


def _stranger(port: int, pids: list[int], run: str) -> dict:
    """What another local user sees of the job, and every namespace they can think of from it."""
    seen: list[str] = []
    cmdline_read = environ_denied = token_file_denied = True
    for pid in pids:
        try:
            seen += Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            cmdline_read = False
        try:
            Path(f"/proc/{pid}/environ").read_bytes()
            environ_denied = False
        except PermissionError:
            pass
    try:
        Path(run, ".job-token").read_text()
        token_file_denied = False
    except PermissionError:
        pass
    parent_listed = Path(run).name in os.listdir(Path(run).parent)  # the run directory itself is what stops them
    words = [w for w in seen if w]
    guesses = words + [hashlib.sha256(f"resilient-train:{w}".encode()).hexdigest()[:32] for w in words]
    return {"cmdline_read": cmdline_read, "argv": words, "environ_denied": environ_denied,
            "token_file_denied": token_file_denied, "parent_listed": parent_listed,
            "found": _keys_under(port, guesses)}


@pytest.mark.timeout(240)
def test_with_no_token_given_another_local_user_cannot_find_the_jobs_namespace() -> None:
    """Issue 26: a two-node job on this machine, no RT_JOB_TOKEN. Another uid reads every agent's command
    line (``--rdzv-id`` included) but not their environment nor the run directory's token file, and no
    namespace it derives from what it read holds the job's keys; the real token's does."""
    if os.geteuid() != 0:
        pytest.skip("becoming another user (os.setuid in a forked child) needs root; the tests run as root in CI")
    base = Path(tempfile.mkdtemp(prefix="rt-trust-", dir="/tmp"))
    os.chmod(base, 0o755)  # the other user may look into the run directory's parent (pytest's tmp is private)
    run = base / "run"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RT_JOB_TOKEN"}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "resilient_train.cli", "run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "1", "--no-spare", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--rdzv-id", "job-id-in-ps", "--run-dir", str(run), str(HOLD)],
        cwd=REPO, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        start_new_session=True) for node in (0, 1)]
    try:
        for a in agents:  # each node's rank is up: the namespace is in use
            ready, _, _ = select.select([a.stdout], [], [], 120)
            assert ready and a.stdout.readline().strip() == "ready", a.stderr.read() if a.poll() is not None else ""
        seen = _as_another_user(_stranger, port, [a.pid for a in agents], str(run))
        assert "error" not in seen and seen["uid"] == NOBODY, seen
        if seen["cmdline_read"]:  # /proc is not mounted hidepid here: the id is there for anyone to read
            assert "job-id-in-ps" in seen["argv"], seen
        assert seen["found"] == [], seen  # no guess reaches the job's keys
        assert seen["environ_denied"] and seen["token_file_denied"] and seen["parent_listed"], seen
        token_file = run / ".job-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and stat.S_IMODE(run.stat().st_mode) == 0o700
        token = token_file.read_text().strip()
        assert _keys_under(port, [token]) == [token]  # the probe can find them: with the token, they are there
        for a in agents:
            a.stdin.write("\n")
            a.stdin.close()
        for a in agents:
            assert a.wait(90) == 0, a.stderr.read()
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
        shutil.rmtree(base, ignore_errors=True)
