"""When a whole-job restart happens, and who is to blame for a failure.

torchrun's rule, kept: every worker is restarted when one fails, up to
``--max-restarts`` times (default 0). Added:

* **blame**: the first worker to exit is the cause; the others (a survivor
  that aborted when its peer's connection closed) are consequences. Exit
  times come from pidfds watched on a thread, to the millisecond, not from
  the order in which the agent happened to look.
* **the same failure twice**: an attempt whose first failure is the same
  exception as the previous attempt's (same last line of its traceback),
  with no progress reported in between, is a bug, not a fault: the job stops
  with exit code 93 (do not requeue) instead of spending the budget on
  identical crashes. Signals, hangs and kills are faults and are restarted.
"""

from __future__ import annotations

import os
import re
import select
import threading
import time
from dataclasses import dataclass
from enum import Enum

__all__ = ["Decision", "ExitClock", "RestartPolicy", "WorkerFailure"]

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


@dataclass(frozen=True, kw_only=True)
class WorkerFailure:
    rank: int
    how: str  # "exit code 1", "signal SIGKILL"
    kind: str  # "exception" (a traceback was printed), "exit", "signal", "hang", "straggler"
    summary: str | None = None  # the exception's last line
    at: float = 0.0  # monotonic exit time

    def describe(self) -> str:
        cause = f": {self.summary}" if self.summary else ""
        return f"rank {self.rank} failed first ({self.how}){cause}"

    def same_as(self, other: WorkerFailure | None) -> bool:
        return (other is not None and self.kind == other.kind == "exception" and self.summary is not None
                and _ADDRESS.sub("0x", self.summary) == _ADDRESS.sub("0x", other.summary or ""))


class Decision(str, Enum):
    RESTART = "restart"
    REPEATED = "repeated"  # the same failure again, without progress: stop (exit 93)
    BUDGET = "budget"  # --max-restarts spent: stop (exit 1)


class RestartPolicy:
    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.restarts = 0
        self._last: WorkerFailure | None = None
        self._last_step = -1  # the highest step any rank reported when the last attempt failed

    def judge(self, failure: WorkerFailure, *, reported_step: int) -> Decision:
        """What :meth:`decide` would answer, changing nothing (the agent's decision function asks this)."""
        if failure.same_as(self._last) and reported_step <= self._last_step:
            return Decision.REPEATED
        return Decision.BUDGET if self.restarts >= self.max_restarts else Decision.RESTART

    def decide(self, failure: WorkerFailure, *, reported_step: int) -> Decision:
        """``reported_step``: the highest step any rank of this attempt reported (-1: none reported)."""
        decision = self.judge(failure, reported_step=reported_step)
        self._last, self._last_step = failure, max(self._last_step, reported_step)
        if decision is Decision.RESTART:
            self.restarts += 1
        return decision


class ExitClock:
    """Records when each watched process exits (``pidfd_open``), on a daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._times: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rt-exit-clock", daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # already reaped, or no pidfds (then the agent's poll time is used)
            return
        with self._lock:
            self._fds[fd] = pid

    def exited_at(self, pid: int) -> float | None:
        with self._lock:
            return self._times.get(pid)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                fds = list(self._fds)
            if not fds:
                self._stop.wait(0.05)
                continue
            try:
                ready, _, _ = select.select(fds, [], [], 0.05)
            except (OSError, ValueError):
                ready = []
            now = time.monotonic()
            with self._lock:
                for fd in ready:
                    pid = self._fds.pop(fd, None)
                    if pid is not None:
                        self._times[pid] = now
                        os.close(fd)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
