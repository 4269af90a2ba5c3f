"""What the agent's pollers report (events) and what the agent does about it (decisions), as data.

A poller looks at one thing (the workers, the hang monitor, the other nodes,
the signals, the warm spares, the saved monitor state) and returns events; it
changes nothing. :func:`resilient_train.agent.decide.decide` turns each event
into one decision, and the loop (:mod:`resilient_train.agent.loop`) carries it
out. Events carry the facts their poller read (from the store, too), so the
decision reads nothing and can be tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from resilient_train.agent.restarts import WorkerFailure

__all__ = [
    "AllSucceeded", "ClaimNode", "Decision", "EnableSpares", "End", "Event", "Fail", "FenceNode", "Fenced", "Ignore",
    "JobEnded", "MoveStore", "NoMajority",
    "Kill", "KillDumped", "Leave", "MarkSucceeded", "MonitorStateDue", "MonitorStateOffered", "NodeAssigned",
    "NodeLost", "PeerStopping", "RankHung", "Replace", "RestartAll", "RunDirFailed", "SaveMonitorState", "ShutDown", "Signalled",
    "SpareDue", "StacksDue", "StartSpare", "StopJob", "StoreUnreachable", "SupervisedSeen", "TakeNode", "TakeOffer",
    "WorkerExited",
]

_E = dict(frozen=True, kw_only=True)


# ------------------------------------------------------------------ events
@dataclass(**_E)
class WorkerExited:
    """A worker's process ended (the workers poller; in exit order, from pidfd exit times)."""

    rank: int
    pid: int
    rc: int
    failure: WorkerFailure | None = None  # how it failed (rc != 0)
    followed: tuple[WorkerFailure, ...] = ()  # the others of the same look that exited after it (for the blame)
    supervised: bool = False  # its rank registered with the Supervisor: replaced in place
    final: bool = False  # the run's final state was committed when it was seen
    early: bool = False  # a Supervisor rank that exited 0 before the final state was committed
    step: int = -1  # the step its progress slot showed last (-1: none)
    stop: dict[str, Any] | None = None  # the job's stop record (a rank stopped the job), when there is one


@dataclass(**_E)
class RankHung:
    """The hang monitor wants ``rank`` killed: ``cause["kind"]`` is "hang" or "straggler" (policy: replace)."""

    rank: int
    pid: int
    cause: dict[str, Any]


@dataclass(**_E)
class StacksDue:
    """A hung rank asked for its stacks has written them, or had its time: kill it now."""

    rank: int
    pid: int


@dataclass(**_E)
class NodeLost:
    node: int
    incarnation: int


@dataclass(**_E)
class Signalled:
    """This agent received one of its forwarded signals."""

    signum: int


@dataclass(**_E)
class PeerStopping:
    """Another node's agent was signalled: the whole job stops."""

    signum: int
    node: int | None


@dataclass(**_E)
class AllSucceeded:
    """Every worker of this node exited 0."""


@dataclass(**_E)
class SupervisedSeen:
    """A rank registered with the Supervisor: the job uses warm spares."""


@dataclass(**_E)
class SpareDue:
    """The spare pool wants its next spare started."""


@dataclass(**_E)
class StoreUnreachable:
    """A store call failed or ran past its deadline (node 0's agent, which hosts it, is gone or stopped, or this
    node is cut off from it)."""

    error: str
    finished: bool = False  # this node's workers had all succeeded
    fenced: bool = False  # a worker of this node exited FENCED: it found its node declared lost, or the store gone


@dataclass(**_E)
class NoMajority:
    """The store's host was lost and no successor opened a store with a majority of the job's agents."""

    error: str  # how the store was lost
    reason: str  # why no store opened
    host_dead: bool  # the host's port refused a connection: its process is gone (this side is not cut off)


@dataclass(**_E)
class Fenced:
    """This node was declared lost while its agent lived (it was stopped, or cut off): it is fenced out; or, the
    store's host, it finds most of the job gone silent (``line`` says so)."""

    how: str
    line: str | None = None


@dataclass(**_E)
class NodeAssigned:
    """A spare node's agent was handed a lost node."""

    node: int


@dataclass(**_E)
class JobEnded:
    """A spare node's agent: the job ended without needing it (``preempted``: stopped by a signal)."""

    preempted: bool


@dataclass(**_E)
class MonitorStateDue:
    """The computed hang timeouts are due to be saved (changed, or the interval passed)."""


@dataclass(**_E)
class MonitorStateOffered:
    """A rank left the monitor state of the checkpoint it resumed from."""


@dataclass(**_E)
class RunDirFailed:
    """The run directory was removed or replaced, or its filesystem became read-only (agent.rundirwatch)."""

    reason: str


Event = Union[WorkerExited, RankHung, StacksDue, NodeLost, Signalled, PeerStopping, AllSucceeded, SupervisedSeen,
              SpareDue, StoreUnreachable, NoMajority, Fenced, NodeAssigned, JobEnded, MonitorStateDue, MonitorStateOffered,
              RunDirFailed]


# --------------------------------------------------------------- decisions
@dataclass(**_E)
class Ignore:
    why: str


@dataclass(**_E)
class MarkSucceeded:
    """The worker is done: it exited 0, or it failed after the run's final state was committed."""

    rank: int
    after_final: WorkerFailure | None = None


@dataclass(**_E)
class StopJob:
    """A rank stopped the job (STOPPING): the ranks leave on their own, the rest are killed after a grace.
    ``request``: the agent stops it itself (a rank that keeps leaving early): the job's stop key is set first."""

    rank: int
    rc: int
    exit_code: int
    reason: str
    request: bool = False


@dataclass(**_E)
class ShutDown:
    """SHUTTING_DOWN: forward ``signum`` (None: a preemption this node's ranks began), the grace, the verdict."""

    signum: int | None
    signalled: bool
    preempted_rank: int | None = None


@dataclass(**_E)
class Replace:
    """A Supervisor rank died: declare its generation failed and start it again in place (from a spare)."""

    failure: WorkerFailure
    step: int = -1  # the step it was at (a rank that left early: the same step twice is a bug)


@dataclass(**_E)
class RestartAll:
    """torchrun's recovery (RESTARTING): every worker again, on a fresh store."""

    failure: WorkerFailure
    followed: tuple[WorkerFailure, ...]
    blame: str


@dataclass(**_E)
class Fail:
    """Give up (FAILED) with a one-line ``message`` and ``exit_code``."""

    message: str
    exit_code: int
    failure: WorkerFailure | None = None  # a worker's death that led to it (reported first)
    restart_decision: str | None = None  # the restart policy's word (a plain script's attempt failed)
    followed: tuple[WorkerFailure, ...] = ()


@dataclass(**_E)
class Kill:
    """Kill a hung rank (after its stacks, when ``dump_stacks``) or a straggler."""

    rank: int
    pid: int
    cause: dict[str, Any]
    dump_stacks: bool


@dataclass(**_E)
class KillDumped:
    rank: int


@dataclass(**_E)
class MoveStore:
    """The store's host is lost: move to its first successor alive, or open this agent's standby store."""

    error: str


@dataclass(**_E)
class ClaimNode:
    """Claim the loss of ``node``'s ``incarnation``; the first claimer fails the generation and hands it on."""

    node: int
    incarnation: int


@dataclass(**_E)
class Leave:
    """This node is done (LEAVING, then DONE) with ``exit_code``."""

    exit_code: int
    reason: str | None = None
    line: str | None = None  # said on the console


@dataclass(**_E)
class End:
    """DONE at once, nothing to leave: a spare node that took no node, or a node whose store went after the end."""

    exit_code: int
    reason: str
    line: str | None = None
    spare_unused: bool = False


@dataclass(**_E)
class FenceNode:
    """FENCED: this node's ranks are killed and the agent exits FENCED without telling the job it left (the
    node is another agent's now, or its next agent's). ``line``: what the console says, when not the words for
    a node declared lost (a node that lost the store cannot know whether it was)."""

    how: str
    line: str | None = None


@dataclass(**_E)
class EnableSpares:
    pass


@dataclass(**_E)
class StartSpare:
    pass


@dataclass(**_E)
class SaveMonitorState:
    pass


@dataclass(**_E)
class TakeOffer:
    pass


@dataclass(**_E)
class TakeNode:
    node: int


Decision = Union[Ignore, MarkSucceeded, StopJob, ShutDown, Replace, RestartAll, Fail, Kill, KillDumped, ClaimNode,
                 Leave, End, FenceNode, EnableSpares, StartSpare, SaveMonitorState, TakeOffer, TakeNode, MoveStore]
