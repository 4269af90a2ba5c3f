"""Running real jobs from tests: the agent, the GPT example, and their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from monitors.events import read_events

REPO = Path(__file__).resolve().parent.parent
GPT = REPO / "examples" / "train_gpt.py"
DDP_EXAMPLE = REPO / "examples" / "train_ddp.py"
# Small enough for 4 ranks on 2 cores, big enough to have every kind of state.
SMALL_GPT = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4", "--log-every", "0",
             "--reproducible"]


OMP_NOTICE = "resilient-train: OMP_NUM_THREADS is set to 1 for each worker"  # torchrun's notice, at every start


def free_port() -> int:
    """A port free on loopback right now (for a test that gives --master-port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_lines(stderr: str) -> list[str]:
    """The non-empty lines of a job's stderr, without the agent's start-up notice."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(OMP_NOTICE)]


def events_now(run_dir: Path) -> list[dict[str, Any]]:
    """The events of ``run_dir`` written so far, read while the job may still write: the project's own reader,
    which skips a line still being appended (read whole at the next call). A job that ended is read strictly
    (:meth:`Job.events`)."""
    return list(read_events(run_dir))


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    def events(self) -> list[dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == name]


def cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "resilient_train.cli", *args], capture_output=True, text=True, timeout=timeout,
        cwd=REPO, env={**os.environ, **(env or {})},
    )


def run_gpt(
    run_dir: Path, *, nproc: int, steps: int, faults: list[dict[str, Any]] | None = None,
    extra: list[str] | None = None, timeout: float = 150, agent_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Job:
    args = ["run", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir), *(agent_args or [])]
    if faults:
        args += ["--chaos", json.dumps(faults)]
    args += [str(GPT), "--steps", str(steps), *SMALL_GPT, *(extra or [])]
    p = cli(*args, timeout=timeout, env=env)
    return Job(p.returncode, p.stdout, p.stderr, run_dir)


SMALL_DDP = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4", "--dataset", "256",
             "--log-every", "0", "--reproducible"]


def run_script(
    run_dir: Path, script: Path, script_args: list[str], *, nproc: int, faults: list[dict[str, Any]] | None = None,
    timeout: float = 150, agent_args: list[str] | None = None, env: dict[str, str] | None = None,
) -> Job:
    args = ["run", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir), *(agent_args or [])]
    if faults:
        args += ["--chaos", json.dumps(faults)]
    p = cli(*args, str(script), *script_args, timeout=timeout, env=env)
    return Job(p.returncode, p.stdout, p.stderr, run_dir)


def run_ddp(run_dir: Path, *, nproc: int, steps: int, faults: list[dict[str, Any]] | None = None,
            timeout: float = 150, agent_args: list[str] | None = None) -> Job:
    return run_script(run_dir, DDP_EXAMPLE, ["--steps", str(steps), *SMALL_DDP], nproc=nproc, faults=faults,
                      timeout=timeout, agent_args=agent_args)


def cli_popen(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``resilient-train ARGS`` in the background, in its own session (a test can signal all of it)."""
    return subprocess.Popen([sys.executable, "-m", "resilient_train.cli", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, **(env or {})})


def start_gpt(run_dir: Path, *, nproc: int, steps: int, faults: list[dict[str, Any]] | None = None,
              agent_args: list[str] | None = None, extra: list[str] | None = None,
              env: dict[str, str] | None = None, script: Path = GPT) -> subprocess.Popen:
    """A GPT job in the background (its own session, so a test can take all of it down)."""
    args = ["run", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir), *(agent_args or [])]
    if faults:
        args += ["--chaos", json.dumps(faults)]
    args += [str(script), "--steps", str(steps), *SMALL_GPT, *(extra or [])]
    return cli_popen(*args, env=env)


def wait_for_event(run_dir: Path, predicate: Any, *, timeout: float, proc: subprocess.Popen | None = None,
                   interval: float = 0.05) -> dict[str, Any]:
    """The first event of ``run_dir`` for which ``predicate(event)`` holds; fails at ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = proc is not None and proc.poll() is not None  # before the read: a last event is not missed
        for e in events_now(run_dir):
            if predicate(e):
                return e
        if ended:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before the event")
        time.sleep(interval)
    raise AssertionError(f"no such event in {timeout} s")


def ckpt_diff(a: Path, b: Path) -> subprocess.CompletedProcess:
    """``resilient-train ckpt diff A B``, run in this process (the command's own code, its output captured):
    a bitwise verdict without a second interpreter's start, which cost 2.5 s a verdict on 2 cores. The
    command line itself is tested in tests/checkpointing."""
    import contextlib
    import io

    from checkpointing.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["diff", str(a), str(b)])
    return subprocess.CompletedProcess(["resilient-train", "ckpt", "diff", str(a), str(b)], code, out.getvalue(),
                                       err.getvalue())


def survivors_kept_pids(job: Job, killed: set[int]) -> None:
    """Every rank that was not killed started once and ended in the same process."""
    starts = job.of("run_start")
    ends = {e["rank"]: e["pid"] for e in job.of("run_end")}
    world = starts[0]["world_size"]
    for rank in range(world):
        if rank in killed:
            continue
        pids = [e["pid"] for e in starts if e["rank"] == rank]
        assert len(pids) == 1, f"rank {rank} started {len(pids)} times"
        assert ends.get(rank) == pids[0], f"rank {rank} ended in pid {ends.get(rank)}, started in {pids[0]}"
