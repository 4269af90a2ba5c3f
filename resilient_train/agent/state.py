"""The agent's lifecycle: one state value, the moves allowed between them, and how the agent ends.

::

    STARTING ──> WAITING_FOR_NODE ──> STARTING          a spare node's agent, until a lost node is handed to it
        │  │            └──────────────────────> DONE   the job ended without it (or it was signalled, or cut off)
        │  └──> FENCED                                 the store lost as it starts (below)
        v
     RUNNING <──> RESTARTING                           torchrun's restart of every worker (a plain script)
        ├──> FENCED ───────────────────────> DONE       this node was declared lost meanwhile, or (not node 0)
        │                                              lost the store and must assume so: it leaves (exit 94)
        ├──> STOPPING ─────┐                           a rank stopped the job (a bug, a full disk, the rerun policy)
        ├──> SHUTTING_DOWN ┤                           a signal (this node's or another's) or a preemption
        ├──────────────────┼──> LEAVING ──> DONE       many nodes: this node is done; node 0 waits for the others
        └──────────────────┴──────────────> DONE       every worker succeeded (one node: no one to wait for)
    (any state but DONE to FAILED: an AgentError, e.g. a budget spent, the store lost, a worker that cannot start)

DONE carries the exit code the agent's policies decided from what happened to
the job (0 finished, 75 preempted, 93 stopped by a rank, 128 + N signalled,
94 this node fenced, ...); FAILED the code of the :class:`AgentError` it gave up on. The flags the
agent used to keep (a stop code, a pending signal, "supervised seen",
"waiting for a node") are this value and the data of the event that moved it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import Enum

from resilient_train.base import exitcodes
from resilient_train.base.transitions import IllegalTransition

__all__ = ["AgentError", "AgentLifecycle", "AgentState", "AgentStopped", "allowed_moves"]


class AgentState(str, Enum):
    STARTING = "starting"  # hosting or reaching the store, starting this node's ranks
    WAITING_FOR_NODE = "waiting_for_node"  # a spare node's agent with no node yet
    RUNNING = "running"  # watching the workers
    RESTARTING = "restarting"  # torchrun's restart of every worker, on a fresh store
    STOPPING = "stopping"  # a rank stopped the job: the ranks leave, the rest are killed after a grace
    SHUTTING_DOWN = "shutting_down"  # a signal or a preemption: the ranks' grace, then SIGKILL and the verdict
    LEAVING = "leaving"  # many nodes: this node is done; node 0 keeps the store until the others are
    FENCED = "fenced"  # declared lost, or cut off from the store (resilient_train.rank.fence): ranks killed, it leaves
    DONE = "done"  # ended with the code its policies decided
    FAILED = "failed"  # gave up (an AgentError)

    @property
    def terminal(self) -> bool:
        return self in (AgentState.DONE, AgentState.FAILED)


_S = AgentState
_ALLOWED: dict[AgentState, frozenset[AgentState]] = {
    _S.STARTING: frozenset({_S.WAITING_FOR_NODE, _S.RUNNING, _S.FENCED, _S.FAILED}),
    _S.WAITING_FOR_NODE: frozenset({_S.STARTING, _S.DONE, _S.FAILED}),
    _S.RUNNING: frozenset({_S.RESTARTING, _S.STOPPING, _S.SHUTTING_DOWN, _S.LEAVING, _S.FENCED, _S.DONE,
                           _S.FAILED}),
    _S.RESTARTING: frozenset({_S.RUNNING, _S.FAILED}),
    _S.STOPPING: frozenset({_S.LEAVING, _S.DONE, _S.FAILED}),
    _S.SHUTTING_DOWN: frozenset({_S.LEAVING, _S.DONE, _S.FAILED}),
    _S.LEAVING: frozenset({_S.DONE, _S.FAILED}),
    _S.FENCED: frozenset({_S.DONE, _S.FAILED}),
    _S.DONE: frozenset(),
    _S.FAILED: frozenset(),
}


def allowed_moves() -> dict[AgentState, frozenset[AgentState]]:
    """The transition table (a copy)."""
    return dict(_ALLOWED)


class AgentError(RuntimeError):
    """A reason to stop, phrased for a one-line message (exit code 1 unless given)."""

    def __init__(self, message: str, exit_code: int = exitcodes.FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class AgentStopped(Exception):
    """A forwarded signal ended the job (exit code 128 + the signal's number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class AgentLifecycle:
    """The agent's state; :meth:`to` raises :class:`IllegalTransition` on a move the table does not allow."""

    state: AgentState = AgentState.STARTING
    exit_code: int | None = None  # set on DONE or FAILED
    reason: str | None = None
    history: list[AgentState] = field(default_factory=lambda: [AgentState.STARTING])

    def to(self, new: AgentState) -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"agent {self.state.value} -> {new.value} is not allowed")
        self.state = new
        self.history.append(new)

    def end(self, exit_code: int, reason: str | None = None) -> int:
        """DONE (or FAILED for an AgentError's code, see :meth:`fail`) with ``exit_code``; returns it."""
        self.to(AgentState.DONE)
        self.exit_code, self.reason = exit_code, reason
        return exit_code

    def fail(self, error: AgentError) -> None:
        if not self.state.terminal:
            self.to(AgentState.FAILED)
        self.exit_code, self.reason = error.exit_code, str(error)
