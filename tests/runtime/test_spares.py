"""A warm spare that becomes a rank is that rank: what it inherits, and where its output goes (issues 22, 26).

Real agents, real workers, a real SIGKILL from outside: rank 1 holds at a step,
the test kills it, the agent hands rank 1 to a warm spare, and the job ends.
Each process of rank 1 recorded what it inherited (tests/runtime/parity_script.py);
the original and its spare-born replacement are compared.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import REPO, Job

SCRIPT = Path(__file__).resolve().parent / "parity_script.py"
PER_RANK = {"RT_GENERATION", "RT_ROLE", "RT_SPAWNED_AT"}  # what differs between a rank and its replacement
BULK_KB = 1024  # the replacement prints 1 MiB: past any pipe's buffer (64 KiB), which nothing would read


def _job_with_a_killed_rank(run: Path, agent_args: list[str], *, timeout: float = 180) -> tuple[Job, int]:
    """Runs the parity script on 2 ranks; SIGKILLs rank 1 (from outside) where it holds; returns the job and the pid."""
    cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "2", "--run-dir", str(run),
           *agent_args, str(SCRIPT), "--steps", "5", "--hold-step", "2", "--print-kb", str(BULK_KB)]
    p = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        hold = run / "parity" / "hold"
        deadline = time.monotonic() + 120
        while not hold.exists():
            assert p.poll() is None, p.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "rank 1 never reached its hold"
            time.sleep(0.02)
        pid = int(hold.read_text())
        os.kill(pid, signal.SIGKILL)
        out, err = p.communicate(timeout=timeout)  # reads the console while the replacement prints its 1 MiB
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return Job(p.returncode, out.decode(errors="replace"), err.decode(errors="replace"), run), pid


def _facts(run: Path, rank: int, pid: int) -> dict:
    facts = json.loads((run / "parity" / f"rank{rank}-{pid}.json").read_text())
    facts["step_environ"] = json.loads((run / "parity" / f"env{rank}-{pid}.json").read_text())
    return facts


def _replacement(job: Job, killed: int) -> int:
    """The pid of rank 1's replacement, which must have come from a warm spare (else nothing is proven)."""
    spawned = [e for e in job.of("worker_spawned") if e["replacement"]]
    assert [(e["rank"], e["warm"]) for e in spawned] == [(1, True)], spawned
    assert spawned[0]["pid"] != killed
    return spawned[0]["pid"]


def _differences(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


@pytest.mark.timeout(300)
def test_a_spare_born_replacement_inherits_what_the_rank_it_replaces_had(tmp_path):
    job, killed = _job_with_a_killed_rank(tmp_path / "run", ["--tee", "3"])
    assert job.returncode == 0, job.stderr[-3000:]
    born = _replacement(job, killed)
    cold, warm = _facts(job.run_dir, 1, killed), _facts(job.run_dir, 1, born)

    # torch's thread pools: sized from the worker environment in both (torchrun's OMP_NUM_THREADS=1 at 2 ranks).
    assert (cold["num_threads"], cold["num_interop_threads"]) == (warm["num_threads"], warm["num_interop_threads"])
    assert warm["num_threads"] == 1
    # The environment the steps run in: the same but for the keys that name the generation and the spawn.
    assert set(_differences(cold.pop("step_environ"), warm.pop("step_environ"))) == PER_RANK
    # At import the replacement may already hold what torch sets on a process's first optimizer (the spare
    # built one warming up), with the value the original got a moment later.
    at_import = _differences(cold.pop("environ"), warm.pop("environ"))
    assert set(at_import) <= PER_RANK | {"TORCHINDUCTOR_CACHE_DIR"}, at_import
    # fds 0-2: the agent's stdin, and pipes of the rank's own relay (--tee), in both.
    fds_cold, fds_warm = cold.pop("fds"), warm.pop("fds")
    assert fds_cold["0"] == fds_warm["0"] and fds_cold["0"]["open"]
    for fd in ("1", "2"):
        assert fds_cold[fd]["kind"] == fds_warm[fd]["kind"] == "fifo"
        assert fds_cold[fd]["ino"] != fds_warm[fd]["ino"]  # each worker's own pipe
    # Everything else the same: threads, interop threads, sys.path, argv, orig_argv, flags, cwd, __main__,
    # signal handlers and mask, resource limits, process group, parent, affinity, umask, stdio modes.
    assert cold.pop("pid") != warm.pop("pid")
    assert _differences(cold, warm) == {}
    assert os.path.isabs(warm["main_file"]) and warm["main_file"] == str(SCRIPT)

    # Output: both processes' stdout and stderr on the console, with the rank's prefix, and in its logs.
    logs = job.run_dir / "logs" / "attempt_0" / "1"
    for pid in (killed, born):
        assert f"[default1]:parity-out rank 1 pid {pid}\n" in job.stdout
        assert f"[default1]:parity-err rank 1 pid {pid}\n" in job.stderr
        assert f"parity-out rank 1 pid {pid}\n" in (logs / "stdout.log").read_text()
        assert f"parity-err rank 1 pid {pid}\n" in (logs / "stderr.log").read_text()
    bulk = [line for line in job.stdout.splitlines() if line.startswith("[default1]:bulk ")]
    assert len(bulk) == BULK_KB and bulk[-1].startswith(f"[default1]:bulk {BULK_KB - 1:07d} ")
    assert (logs / "stdout.log").read_text().count("\nbulk ") == BULK_KB


@pytest.mark.timeout(300)
def test_a_spare_born_replacement_that_prints_a_megabyte_finishes_the_job(tmp_path):
    """Issue 26.1: with no --tee, a replacement's stdout is the agent's, as a cold worker's is; it never blocks."""
    job, killed = _job_with_a_killed_rank(tmp_path / "run", [])
    assert job.returncode == 0, job.stderr[-3000:]
    born = _replacement(job, killed)
    assert not [e for e in job.of("fault_detected") if e.get("kind") == "hang"], "a rank was killed as hung"
    lines = job.stdout.splitlines()
    assert [f"bulk {i:07d}" for i in range(BULK_KB)] == [line[:12] for line in lines if line.startswith("bulk ")]
    assert f"parity-bulk-done rank 1 pid {born}" in lines
    assert f"parity-err rank 1 pid {born}" in job.stderr.splitlines()


PROBE = """
import os, sys
main = sys.modules["__main__"]
spec = main.__spec__
print({k: v for k, v in vars(main).items() if k in ("__name__", "__file__", "__package__", "__cached__", "__doc__")})
print(sorted(vars(main)), type(main.__loader__).__name__, spec and (spec.name, spec.origin))
print(sys.argv, sys.orig_argv, sys.path[0], os.getcwd(), tuple(sys.flags), sys.stdin.read())
def fail(): raise ValueError("from the script")
fail()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["script", "module"])
def test_a_spare_runs_a_script_or_module_as_python_does(tmp_path, monkeypatch, kind):
    """The spare's side alone, against ``python`` itself: __main__, sys.*, stdout, the traceback, the exit code.

    The script is handed to a ready spare; the module to one still importing torch (a replacement may take
    a spare that is not warm yet: the handover waits in its socket)."""
    from resilient_train.agent.entry import Entry, EntryKind
    from resilient_train.agent.spares import Spare, SpareState, spare_env

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    entry = Entry(kind=EntryKind.MODULE, target="pkg.probe") if kind == "module" else Entry(
        kind=EntryKind.SCRIPT, target="pkg/probe.py")
    env = dict(os.environ)
    spare = Spare(entry, ["a", "b c"], spare_env(env))
    try:
        if kind == "script":
            assert spare.poll(90) is SpareState.READY
        else:
            assert spare.state is SpareState.WARMING  # started a moment ago: torch takes a second to import
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        assert spare.hand_over(env, (stdin, out_w, err_w))
        for fd in (stdin, out_w, err_w):
            os.close(fd)
        with os.fdopen(out_r, "rb") as out, os.fdopen(err_r, "rb") as err:
            warm = (out.read(), err.read(), spare.proc.wait(60))
    finally:
        spare.close()
        if spare.proc.poll() is None:
            spare.proc.kill()
    cold = subprocess.run(entry.argv(["a", "b c"]), stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    assert warm == (cold.stdout, cold.stderr, cold.returncode) and cold.returncode == 1
    assert b'ValueError: from the script' in cold.stderr and str(tmp_path).encode() in cold.stdout
