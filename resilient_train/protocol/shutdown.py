"""Shutdown and preemption: one grace from the signal to the last rank's exit, one exit code on every node.

The grace is one number of seconds, counted from the signal (or from the moment
a rank or an agent first learns of the stop). A Supervisor rank spends it on its
checkpoint (the save in flight, then the preemption's own save) and its exit;
the agents spend it waiting for their ranks and SIGKILL what is left at its
end. Each rank publishes its grace in the store (:meth:`ShutdownKeys.grace`),
so an agent follows its ranks (``PreemptionConfig.grace_s``) and never cuts a
save short with a timeout of its own; ``--shutdown-timeout`` keeps torchrun's
meaning for scripts without the Supervisor.

The default grace is :data:`DEFAULT_GRACE_S`, grown to cover twice the longest
save the job has made (a save in flight, then the preemption's), half again for
slack (two saves back to back take longer than two apart: the second waits on
the first one's writeback), and the rank's exit (:func:`auto_grace`): a job
with large checkpoints gets a longer grace by itself (README: the measurements).

The exit code comes from what the ranks did, not from how they ended: each rank
records its preemption in the store (:meth:`ShutdownKeys.preempted`: the step,
then whether its checkpoint committed). A commit is the job's (rank 0 commits
once every rank has written), so one committed record is enough: every node's
agent then exits REQUEUE (75), even for a rank it had to kill after the commit.
A preemption whose checkpoint did not commit exits 75 too (started again, the
job resumes from its newest committed checkpoint), and says so. Ranks that
recorded no preemption (a plain script) give torchrun's 128 + the signal.

Many nodes: a signalled agent sets :attr:`ShutdownKeys.STOPPING`; every other
agent sees it within a second, forwards the same signal to its own ranks and
starts the same grace. Node 0's agent, which hosts the store, keeps it up until
every node has left or the grace, plus :data:`LEAVE_MARGIN_S`, is over.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch.distributed as dist

from resilient_train.base import exitcodes
from resilient_train.protocol.store import read_stop

__all__ = ["DEFAULT_GRACE_S", "EXIT_RESERVE_S", "PLAIN_SHUTDOWN_TIMEOUT_S", "Shutdown", "ShutdownKeys", "ShutdownExit",
           "auto_grace", "check_seconds", "publish_grace", "record_preempted"]

DEFAULT_GRACE_S = 60.0  # the least a preemption gets (README: what it covers, measured)
PLAIN_SHUTDOWN_TIMEOUT_S = 30.0  # torchrun's --shutdown-timeout, for scripts without the Supervisor
MAX_SECONDS = 7 * 24 * 3600.0  # a longer grace or timeout is a typo (or inf): refused
EXIT_RESERVE_S = 2.0  # the part of the grace a rank keeps for its exit after the checkpoint
SAVE_SLACK = 1.5  # two saves back to back are slower than two alone (the second waits on the first's writeback)
LEAVE_MARGIN_S = 3.0  # node 0 keeps the store this long past the grace, for the other nodes to leave
_POLL_S = 0.05
_REREAD_S = 0.5  # how often a waiting agent reads its ranks' graces and records again
_STOPPING_EVERY_S = 1.0  # how often an agent of a many-node job looks for another node's signal


def check_seconds(value: object, what: str, *, zero_ok: bool = False) -> float:
    """``value`` as seconds, finite and in range; ``ValueError`` with a one-line message otherwise."""
    low = "[0" if zero_ok else "(0"
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero_ok) or value > MAX_SECONDS):
        raise ValueError(f"{what} must be a finite number of seconds in {low}, {MAX_SECONDS:g}], got {value!r}")
    return float(value)


def auto_grace(longest_save_s: float) -> float:
    """The default grace once the job has measured a save of ``longest_save_s`` seconds."""
    return max(DEFAULT_GRACE_S, 2 * SAVE_SLACK * longest_save_s + EXIT_RESERVE_S)


class ShutdownKeys:
    STOPPING = "rt/shutdown/stopping"  # JSON {node, signal}: an agent was signalled; the whole job stops

    @staticmethod
    def grace(rank: int) -> str:
        return f"rt/shutdown/grace/{rank}"  # this Supervisor rank's grace, in seconds (set at start, grown by saves)

    @staticmethod
    def preempted(rank: int) -> str:
        return f"rt/shutdown/preempted/{rank}"  # JSON {step, committed}: null while its checkpoint is being saved


def publish_grace(store: dist.Store, rank: int, grace_s: float) -> None:
    store.set(ShutdownKeys.grace(rank), repr(float(grace_s)))


def record_preempted(store: dist.Store, rank: int, *, step: int, committed: bool | None) -> None:
    store.set(ShutdownKeys.preempted(rank), json.dumps({"step": step, "committed": committed}))


@dataclass(frozen=True, kw_only=True)
class ShutdownExit:
    """How one agent ends a shutdown: its exit code and its one line (None: torchrun's, nothing more to say)."""

    exit_code: int
    line: str | None
    reason: str
    step: int | None = None
    committed: bool = False


class Shutdown:
    """One agent's side of a shutdown: when it began, the grace, the deadline, and the verdict.

    ``ranks`` are this node's; ``timeout_s`` is ``--shutdown-timeout`` (``timeout_given``: on the
    command line), used when no rank published a grace (a script without the Supervisor).
    """

    def __init__(self, *, node: int, nnodes: int, ranks: Iterable[int], timeout_s: float, timeout_given: bool) -> None:
        self.node, self.nnodes = node, nnodes
        self.ranks = sorted(ranks)
        self.timeout_s, self.timeout_given = timeout_s, timeout_given
        self.began_at: float | None = None  # monotonic
        self.signum: int | None = None
        self.signalled = False  # this agent received the signal (not another node's agent)
        self.from_node: int | None = None  # the node whose agent was signalled, when it is another
        self.store_lost = False
        self._graces: dict[int, float] = {}
        self._records: dict[int, dict] = {}
        self._stop: dict | None = None  # a rank stopped the job meanwhile (a full disk, a bug): its code stands
        self._read_at = 0.0
        self._stopping_at = 0.0

    # ---------------------------------------------------------------- when
    def begin(self, store: dist.Store, signum: int | None, *, signalled: bool) -> None:
        """The job is stopping: this agent received ``signum`` (``signalled``), or learned of it."""
        if self.began_at is None:
            self.began_at = time.monotonic()
        self.signum = self.signum or signum
        self.signalled = self.signalled or signalled
        if signalled and self.nnodes > 1:
            # Tells every node (they forward the signal to their ranks and start the same grace).
            self._call(lambda: store.compare_set(ShutdownKeys.STOPPING, "",
                                                 json.dumps({"node": self.node, "signal": signum})))
        self._read(store)

    def stopping(self, store: dist.Store) -> int | None:
        """Another node's signal (a many-node job), looked for about once a second: its number, else None."""
        now = time.monotonic()
        if self.nnodes == 1 or now - self._stopping_at < _STOPPING_EVERY_S:
            return None
        self._stopping_at = now
        if not store.check([ShutdownKeys.STOPPING]):
            return None
        info = json.loads(store.get(ShutdownKeys.STOPPING).decode())
        self.from_node = int(info["node"])
        return int(info["signal"]) if info.get("signal") is not None else int(signal.SIGTERM)

    @property
    def grace_s(self) -> float | None:
        """The longest grace this node's ranks published; None: none did (no Supervisor)."""
        return max(self._graces.values()) if self._graces else None

    @property
    def supervised(self) -> bool:
        return bool(self._graces)

    @property
    def deadline(self) -> float:
        assert self.began_at is not None
        grace = self.grace_s
        return self.began_at + (grace if grace is not None else self.timeout_s)

    @property
    def leave_by(self) -> float:
        """Node 0 keeps the store up until the other nodes left, or until this time (monotonic)."""
        return self.deadline + LEAVE_MARGIN_S

    def received_line(self) -> str:
        name = signal.Signals(self.signum).name if self.signum else "a stop"
        if not self.supervised:
            return f"received {name}: forwarding it to the workers (SIGKILL after {self.timeout_s:g} s)"
        grace = self.grace_s
        assert grace is not None
        aside = ("; --shutdown-timeout is for scripts without the Supervisor"
                 if self.timeout_given and self.timeout_s != grace else "")
        return (f"received {name}: the ranks stop at their next step boundary after a checkpoint "
                f"(SIGKILL after {grace:g} s, their preemption grace{aside})")

    # ---------------------------------------------------------------- wait
    def wait(self, store: dist.Store, procs: Callable[[], dict[int, subprocess.Popen]], *,
             died: Callable[[int, int], None] | None = None) -> list[int]:
        """Until every worker of this node exited, or the deadline (which a rank's grown grace moves): the
        ranks still running then (to be SIGKILLed). ``died(rank, code)``: once for each worker that ends
        otherwise than stopped (0) or checkpointed for the preemption (75) meanwhile, a SIGKILL from outside
        say, whose peers must not wait for it."""
        seen: set[int] = set()
        while any(p.poll() is None for p in procs().values()) and time.monotonic() < self.deadline:
            if died is not None:
                for rank, p in procs().items():
                    code = p.poll()
                    if code is not None and code not in (exitcodes.OK, exitcodes.REQUEUE) and rank not in seen:
                        seen.add(rank)
                        died(rank, code)
            if time.monotonic() - self._read_at >= _REREAD_S:
                self._read(store)
            time.sleep(_POLL_S)
        return sorted(rank for rank, p in procs().items() if p.poll() is None)

    # ------------------------------------------------------------- verdict
    def verdict(self, store: dist.Store, exit_codes: dict[int, int | None]) -> ShutdownExit:
        """The exit code from what the ranks recorded (the store), else from how this node's workers ended."""
        self._read(store)
        name = signal.Signals(self.signum).name if self.signum else None
        by = (f" ({name})" if self.signalled else f" ({name} to node {self.from_node})"
              if self.from_node is not None else "") if name else ""
        if self._stop is not None:
            code = int(self._stop.get("exit_code", exitcodes.STOPPED))
            why = f"rank {self._stop.get('rank')} stopped it: {self._stop.get('summary')}"
            return ShutdownExit(exit_code=code, line=f"job stopped{by}: {why} (exit code {code})", reason=why)
        if self.supervised and exit_codes and all(rc == 0 for rc in exit_codes.values()):
            # The ranks were past their last step (a plain script's exits say nothing: torchrun's 128 + N).
            return ShutdownExit(exit_code=exitcodes.OK, line="the job had finished when the signal came (exit code 0)",
                           reason="finished")
        steps = [r["step"] for r in self._records.values() if isinstance(r.get("step"), int)]
        if steps:
            step = max(steps)
            committed = any(r.get("committed") is True and r.get("step") == step for r in self._records.values())
            code = exitcodes.REQUEUE
            if committed:
                how = f"every rank stopped at step {step}; its checkpoint is committed; start the job again to resume"
            else:
                grace = self.grace_s
                within = f" within the grace ({grace:g} s)" if grace is not None else ""
                how = (f"the ranks stopped at step {step} but its checkpoint did not commit{within}; started again, "
                       "the job resumes from its newest committed checkpoint")
            return ShutdownExit(exit_code=code, line=f"preempted{by}: {how} (exit code {code})", step=step,
                           committed=committed, reason=f"preempted at step {step}")
        if any(rc == exitcodes.REQUEUE for rc in exit_codes.values()):
            # No record to read (the store went with node 0): the ranks' own word.
            code = exitcodes.REQUEUE
            return ShutdownExit(exit_code=code, line=f"preempted{by}: the ranks checkpointed and stopped; start the job "
                           f"again to resume (exit code {code})", reason="preempted")
        code = 128 + self.signum if self.signum else exitcodes.FAILED
        if self.supervised:
            line = (f"stopped{by} before any rank reached a step boundary to checkpoint at; started again, the job "
                    f"resumes from its newest committed checkpoint (exit code {code})")
        else:
            line = None  # torchrun's shutdown: the first line said it all
        return ShutdownExit(exit_code=code, line=line, reason=f"received {name}" if name else "stopped")

    # ------------------------------------------------------------ helpers
    def _read(self, store: dist.Store) -> None:
        """This node's ranks' graces and records, and rank 0's record (the committer's: read while the store
        is up, it says whether the checkpoint committed even if this node's ranks gave up first)."""
        self._read_at = time.monotonic()
        ranks = sorted(set(self.ranks) | {0})

        def read() -> None:
            for rank in ranks:
                if rank in self.ranks and store.check([ShutdownKeys.grace(rank)]):
                    self._graces[rank] = float(store.get(ShutdownKeys.grace(rank)).decode())
                if store.check([ShutdownKeys.preempted(rank)]):
                    self._records[rank] = json.loads(store.get(ShutdownKeys.preempted(rank)).decode())
            self._stop = read_stop(store)

        self._call(read)

    def _call(self, fn: Callable[[], object]) -> None:
        # The store may be gone (node 0's agent ended first): what was read before stands.
        if self.store_lost:
            return
        try:
            fn()
        except dist.DistError:
            self.store_lost = True
