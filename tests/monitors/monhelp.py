"""Helpers of the monitor tests, in a module of its own name: a spawned child imports its test module, and
`from conftest import ...` there finds whichever conftest.py comes first on sys.path (tests/conftest.py in a full run)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Callable, Sequence, TypeVar

import pytest

from monitors.progressreader import ProgressReader

T = TypeVar("T")
CTX = mp.get_context("spawn")


def wait_for(
    cond: Callable[[], T | None], timeout: float, what: str, every: float = 0.01,
    alive: Sequence[mp.process.BaseProcess] = (),
) -> T:
    """Polls ``cond`` until it returns a truthy value; fails the test after ``timeout`` seconds,
    or as soon as one of the ``alive`` processes has exited."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        dead = [p for p in alive if p.exitcode is not None]
        if dead:
            pytest.fail(f"worker {dead[0].name} exited with {dead[0].exitcode} while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def wait_step(run_dir: str, rank: int, step: int, timeout: float = 30.0, pid: int | None = None) -> None:
    """Waits until rank's slot (written by ``pid`` when given) shows ``step`` or later."""
    reader = ProgressReader(run_dir, rank)

    def reached() -> bool:
        snap = reader.read()
        return snap is not None and snap.step >= step and (pid is None or snap.pid == pid)

    wait_for(reached, timeout, f"rank {rank} to reach step {step}")
    reader.close()


class Procs:
    """Spawned worker processes, always SIGKILLed and reaped at the end of a test."""

    def __init__(self) -> None:
        self.procs: list[mp.process.BaseProcess] = []
        self.keep: list[object] = []  # shared objects the children use

    def start(self, target: Callable[..., None], *args: object) -> mp.process.BaseProcess:
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.join(timeout=10)
