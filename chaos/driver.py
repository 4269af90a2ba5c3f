"""Runs one job through the public CLI and drives it from outside.

The job is ``python -m resilient_train.cli run ...`` in its own session, so a
timeout kills all of it. While it runs, the driver fires the faults that live
outside the ranks (a store outage: the agent, which hosts the store, is
SIGSTOPped; a corrupted checkpoint file) and checks every new ``latest``
checkpoint pointer against its manifest and checksums.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos.faults import dumps_faults
from chaos.schedule import CORRUPT_CKPT, STORE_OUTAGE, PlannedFault
from chaos.scenario import JobSpec
from resilient_train.base import exitcodes

__all__ = ["DriverFired", "JobRun", "run_job"]

_POLL_S = 0.1
MAX_REQUEUES = 3  # starts of a job that keeps being preempted
REQUEUE_EXIT = exitcodes.REQUEUE
_DEFAULT_OUTAGE_S = 1.5


@dataclass(kw_only=True)
class DriverFired:
    index: int  # in the plan
    time: float  # epoch seconds
    end: float | None = None  # a lasting fault's end
    detail: str = ""


@dataclass(kw_only=True)
class JobRun:
    run_dir: Path
    returncode: int | None
    timed_out: bool
    launch_time: float
    end_time: float
    driver_fired: list[DriverFired] = field(default_factory=list)
    latest_checked: int = 0
    latest_violations: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.end_time - self.launch_time

    def log_tail(self, lines: int = 15) -> str:
        log = self.run_dir / "job.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def _command(job: JobSpec, run_dir: Path, faults_json: str, monitor_file: str | None, max_restarts: int) -> list[str]:
    cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", str(job.ranks),
           "--run-dir", str(run_dir), "--max-restarts", str(max_restarts),
           "--max-replacements", str(max_restarts)]
    if not job.spare:
        cmd.append("--no-spare")
    if monitor_file:
        cmd += ["--monitor-config", monitor_file]
    if faults_json != "[]":
        cmd += ["--chaos", faults_json]
    return cmd + job.argv()


def run_job(job: JobSpec, run_dir: Path, *, faults: list[PlannedFault], timeout_s: float) -> JobRun:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    monitor_file = None
    if job.monitor:
        monitor_file = str(run_dir / "monitor.json")
        Path(monitor_file).write_text(json.dumps(job.monitor))
    restarts = job.max_restarts if job.max_restarts is not None else max(10, 2 * sum(len(f.ranks) for f in faults))
    launch = time.time()
    in_rank = [x for f in faults for x in f.to_faults(launch_time=launch)]
    cmd = _command(job, run_dir, dumps_faults(in_rank), monitor_file, restarts)
    (run_dir / "command.json").write_text(json.dumps(cmd))
    env = {**os.environ, "RT_REPRODUCIBLE": "1", **job.env}

    def start() -> subprocess.Popen:
        with open(run_dir / "job.log", "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    run = JobRun(run_dir=run_dir, returncode=None, timed_out=False, launch_time=launch, end_time=launch)
    watch = _Watch(job, run, start(), faults)
    # A preempted job (exit 75, a SIGTERM fault) is started again, as a requeueing scheduler would.
    for _ in range(MAX_REQUEUES):
        watch.loop(launch + timeout_s)
        if run.returncode != REQUEUE_EXIT or run.timed_out:
            break
        watch.proc = start()
    return run


class _Watch:
    def __init__(self, job: JobSpec, run: JobRun, proc: subprocess.Popen, faults: list[PlannedFault]) -> None:
        self.run, self.proc = run, proc
        self.pending = {i: f for i, f in enumerate(faults) if f.driver}
        self.resume_at: float | None = None  # when to SIGCONT the agent
        self.events_path = run.run_dir / "events.jsonl"
        self.offset = 0
        self.max_step = 0
        self.ckpt_root = run.run_dir / job.checkpoint_dir
        self.last_latest: int | None = None
        self.corrupted: set[str] = set()

    def loop(self, deadline: float) -> None:
        try:
            while True:
                self._tail_events()
                self._fire_due()
                self._check_latest()
                rc = self.proc.poll()
                if rc is not None:
                    self.run.returncode = rc
                    break
                if time.time() > deadline:
                    self.run.timed_out = True
                    break
                time.sleep(_POLL_S)
        finally:
            self._stop()
            self.run.end_time = time.time()
            self._check_latest()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the agent, its ranks and its spare
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def _tail_events(self) -> None:
        try:
            with open(self.events_path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "step_done":
                self.max_step = max(self.max_step, int(e.get("step", 0)))

    def _fire_due(self) -> None:
        now = time.time()
        if self.resume_at is not None and now >= self.resume_at:
            self._signal_agent(signal.SIGCONT)
            self.resume_at = None
        for i, f in list(self.pending.items()):
            due = (f.at_s is not None and now - self.run.launch_time >= f.at_s) or (
                f.step is not None and self.max_step >= f.step)
            if not due or (f.kind == STORE_OUTAGE and self.resume_at is not None):
                continue
            del self.pending[i]
            fired = self._fire(i, f, now)
            if fired is not None:
                self.run.driver_fired.append(fired)

    def _fire(self, i: int, f: PlannedFault, now: float) -> DriverFired | None:
        if f.kind == STORE_OUTAGE:
            duration = f.duration_s or _DEFAULT_OUTAGE_S
            if not self._signal_agent(signal.SIGSTOP):
                return None
            self.resume_at = now + duration
            return DriverFired(index=i, time=now, end=now + duration, detail=f"agent {self.proc.pid} stopped {duration:g} s")
        if f.kind == CORRUPT_CKPT:
            hit = _corrupt_newest(self.ckpt_root)
            if hit is None:
                return None
            self.corrupted.add(str(hit.parent))
            return DriverFired(index=i, time=now, detail=f"flipped a byte of {hit}")
        raise AssertionError(f.kind)

    def _signal_agent(self, sig: signal.Signals) -> bool:
        try:
            os.kill(self.proc.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _check_latest(self) -> None:
        from checkpointing import CheckpointError, verify_checkpoint
        from checkpointing.catalog import read_latest, step_dir

        latest = read_latest(self.ckpt_root)
        if latest is None or latest == self.last_latest:
            return
        self.last_latest = latest
        path = step_dir(self.ckpt_root, latest)
        if str(path) in self.corrupted:
            return
        try:
            verify_checkpoint(path)
            self.run.latest_checked += 1
        except CheckpointError as e:
            if read_latest(self.ckpt_root) == latest and path.exists():  # not merely retired meanwhile
                self.run.latest_violations.append(f"latest -> step-{latest}: {e}")


def _corrupt_newest(root: Path) -> Path | None:
    """Flips one byte in the middle of the largest file of the newest committed checkpoint."""
    from checkpointing.catalog import list_steps

    committed = [s for s in list_steps(root) if s.has_manifest]
    if not committed:
        return None
    files = [p for p in committed[-1].path.rglob("*") if p.is_file() and p.name != "manifest.json"]
    if not files:
        return None
    target = max(files, key=lambda p: p.stat().st_size)
    with open(target, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([(b[0] if b else 0) ^ 0xFF]))
    return target


