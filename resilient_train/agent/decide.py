"""The agent's decisions, in one place: each poller's event, with a frozen view of the agent, to one decision.

One rule per kind of event (:data:`RULES`); the loop carries each kind of
decision out with one action (resilient_train.agent.act).

Nothing here acts or reads the store: the events carry what their pollers
read, and :class:`View` what the agent knows (its state, its workers, its
budgets). The loop carries the decision out. The rules, by event:

* a worker exited: 0 is done, but for a Supervisor rank before the run's
  final state is committed (it left its loop early: a fault the first time,
  replaced; at the same step again, a bug: the job stops with 93); a rank
  that stopped the job (exit 93, or any
  failure once the job's stop key is set), 17 (the rerun policy) stop it here
  too; 75 is a preemption its ranks began; any other failure after the run's
  final state is committed is ignored; a Supervisor rank is replaced in place
  (within ``--max-replacements``); a plain script's workers are all restarted,
  torchrun's way, within ``--max-restarts`` (resilient_train.agent.restarts: the
  first to exit is blamed, the same crash twice without progress stops it);
* a rank hung (or a straggler, under the "replace" policy): killed, a hung
  one after its stacks are dumped;
* a node lost: claimed (the first claimer hands it to a spare);
* a signal, or another node's: the shutdown (resilient_train.protocol.shutdown);
* every worker succeeded: leave the job with 0;
* this node declared lost while its agent lived (its own loss key, or a rank
  that exited FENCED): fenced, exit 94 (resilient_train.rank.fence);
* the store lost: 0 if this node's ranks had finished; its own store failed
  under the host: exit 1; a many-node job's other agents move with it to the
  first successor alive (resilient_train.agent.succession, ``MoveStore``);
  without a succession, or with no successor opening (no majority), fenced,
  exit 94: this side may be the one cut off, and cannot know whether the job
  declared it lost; with the host's process known dead and no majority, the
  job stops to be resumed (75);
* the run directory removed, replaced or read-only: the job stops with 74
  (nothing can be written: checkpoints, events, the final state).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, get_args

from resilient_train.base import exitcodes
from resilient_train.agent.events import (
    AllSucceeded, ClaimNode, Decision, EnableSpares, End, Event, Fail, FenceNode, Fenced, Ignore, JobEnded, Kill,
    KillDumped, Leave, MoveStore, NoMajority,
    MarkSucceeded, MonitorStateDue, MonitorStateOffered, NodeAssigned, NodeLost, PeerStopping, RankHung, Replace,
    RestartAll, RunDirFailed, SaveMonitorState, ShutDown, Signalled, SpareDue, StacksDue, StartSpare, StopJob, StoreUnreachable,
    SupervisedSeen, TakeNode, TakeOffer, WorkerExited,
)
from resilient_train.agent.state import AgentState
from resilient_train.agent.restarts import Decision as Restart
from resilient_train.agent.restarts import WorkerFailure, RestartPolicy

__all__ = ["RULES", "View", "blame", "decide"]


@dataclass(frozen=True, kw_only=True)
class View:
    """What a decision may look at: a copy of the agent's state, taken before each event."""

    state: AgentState
    nnodes: int = 1
    hosting: bool = True  # node 0's agent: the store lives in this process
    movable: bool = False  # another agent of a many-node job that knows the store's succession
    store_address: str = "127.0.0.1:0"
    pids: Mapping[int, int] = field(default_factory=dict)  # rank -> the pid of its running worker
    killing: frozenset[int] = frozenset()  # ranks already being killed (a hang, a straggler)
    replacements: int = 0
    max_replacements: int = 10
    max_restarts: int = 0
    attempt: int = 0  # restarts of every worker so far
    restart_policy: RestartPolicy = field(default_factory=lambda: RestartPolicy(0))  # asked, never changed here
    reported_step: int = -1  # the highest step a rank of this attempt reported
    finished: bool = False  # every worker of this node exited 0
    early_exits: frozenset[tuple[int, int]] = frozenset()  # (rank, step): Supervisor ranks that left early


def decide(view: View, event: Event) -> Decision:
    """The one decision for ``event``: its kind's rule (one per kind of event, :data:`RULES`)."""
    return RULES[type(event)](view, event)


def _rank_hung(view: View, e: RankHung) -> Decision:
    if view.pids.get(e.rank) != e.pid or e.rank in view.killing:
        return Ignore(why=f"rank {e.rank} is already gone or being killed")
    return Kill(rank=e.rank, pid=e.pid, cause=e.cause, dump_stacks=e.cause["kind"] == "hang")


def _signalled(view: View, e: Signalled) -> Decision:
    if view.state is AgentState.WAITING_FOR_NODE:  # a spare that took no node: the job goes on
        name = signal.Signals(e.signum).name
        return End(exit_code=128 + e.signum, reason="signalled while spare",
                   line=f"received {name}: this spare node agent leaves; the job goes on")
    return ShutDown(signum=e.signum, signalled=True)


def _fenced(view: View, e: Fenced) -> Decision:
    # Declared lost after its ranks had finished (it was stopped at the end): it did its part.
    return Leave(exit_code=exitcodes.OK) if view.finished else FenceNode(how=e.how, line=e.line)


def _job_ended(view: View, e: JobEnded) -> Decision:
    if e.preempted:  # the job is requeued, and so is this spare
        return End(exit_code=exitcodes.REQUEUE, reason="preempted", spare_unused=True,
                   line=f"the job was preempted before it needed this spare node (exit code {exitcodes.REQUEUE})")
    return End(exit_code=exitcodes.OK, reason="finished", spare_unused=True,
               line="the job ended without needing this spare node")


def _run_dir_failed(view: View, e: RunDirFailed) -> Decision:
    # No rank can write its checkpoints, events or final state.
    return StopJob(rank=-1, rc=0, exit_code=exitcodes.STORAGE, reason=e.reason, request=True)


def _worker_exited(view: View, e: WorkerExited) -> Decision:
    if view.pids.get(e.rank) != e.pid:
        return Ignore(why=f"rank {e.rank}'s worker {e.pid} was replaced meanwhile")  # a restart of every worker
    if e.early and (e.rank, e.step) in view.early_exits:
        at = f" at step {e.step}" if e.step >= 0 else ""
        return StopJob(rank=e.rank, rc=e.rc, exit_code=exitcodes.STOPPED, request=True,
                       reason=f"rank {e.rank} left its training loop with exit code 0{at}, again after its "
                              "replacement reached the same step: a bug in the script (a sys.exit or return "
                              "inside the step?), not a fault")
    if e.rc == 0 and not e.early:
        return MarkSucceeded(rank=e.rank)
    if e.rc == exitcodes.FENCED:
        # It saw its node declared lost (resilient_train.rank.fence): so was this agent, stopped meanwhile.
        return FenceNode(how=f"rank {e.rank} found its node declared lost and left")
    if e.rc == exitcodes.STOPPED or e.stop is not None:
        # A rank stopped the job (a bug that reproduced, a misuse, a full disk): nothing to replace.
        stop = e.stop or {"summary": f"rank {e.rank} exited with code {e.rc}"}
        who = stop.get("rank", e.rank)  # -1: an agent stopped it (an elastic job below its MIN nodes)
        return StopJob(rank=e.rank, rc=e.rc, exit_code=int(stop.get("exit_code", exitcodes.STOPPED)),
                       reason=str(stop.get("summary")) if who == -1 else f"rank {who} stopped it: {stop.get('summary')}")
    if e.rc == exitcodes.REQUEUE:
        # Preempted: every rank stopped at one boundary after its checkpoint (resilient_train.rank.preempt).
        return ShutDown(signum=None, signalled=False, preempted_rank=e.rank)
    if e.rc == exitcodes.VALIDATION_FAILED:
        # The rerun policy stopped the job after saving the last good state: not a rank to replace.
        return StopJob(rank=e.rank, rc=e.rc, exit_code=e.rc, reason="the rerun policy stopped the job")
    failure = e.failure
    assert failure is not None, "a failed worker carries its failure"
    if e.final:
        return MarkSucceeded(rank=e.rank, after_final=failure)  # the run is over whatever happens now
    if e.supervised:
        if view.replacements + 1 > view.max_replacements:
            return Fail(message=f"rank {e.rank} died ({failure.how}) and the replacement budget "
                        f"({view.max_replacements}, --max-replacements) is spent", exit_code=exitcodes.FAILED,
                        failure=failure)
        return Replace(failure=failure, step=e.step)
    if view.nnodes > 1:
        return Fail(message=f"{failure.describe()}; restarting every worker of a plain script across nodes is not "
                    "supported yet (the Supervisor's ranks are replaced in place on any node)",
                    exit_code=exitcodes.FAILED, failure=failure)
    said = blame(failure, e.followed)
    verdict = view.restart_policy.judge(failure, reported_step=view.reported_step)
    if verdict is Restart.REPEATED:
        return Fail(message=f"{said}, the same failure as attempt {view.attempt - 1} with no progress in between: "
                    "a bug, not a fault; not restarting", exit_code=exitcodes.STOPPED, failure=failure,
                    restart_decision=verdict.value, followed=e.followed)
    if verdict is Restart.BUDGET:
        budget = view.max_restarts
        return Fail(message=f"{said}; " + ("no restarts allowed (--max-restarts 0)" if budget == 0 else
                                           f"the restart budget ({budget}, --max-restarts) is spent"),
                    exit_code=exitcodes.FAILED, failure=failure, restart_decision=verdict.value, followed=e.followed)
    return RestartAll(failure=failure, followed=e.followed, blame=said)


def blame(failure: WorkerFailure, followed: tuple[WorkerFailure, ...]) -> str:
    """Who is to blame, in one line: the first to exit, and those that followed it."""
    hung = [o.rank for o in followed if o.kind == "hang"]
    if failure.kind == "hang" and hung:
        # Hung together: a rank waiting in a collective on a hung peer looks the same from outside.
        ranks = ", ".join(str(r) for r in sorted([failure.rank, *hung]))
        return f"ranks {ranks} hung ({failure.summary})"
    others = [f"rank {o.rank} ({o.how})" for o in followed]
    return failure.describe() + (f"; {', '.join(others)} followed" if others else "")


def _store_lost(view: View, e: StoreUnreachable) -> Decision:
    if e.finished:
        # The job's end came before the store went (node 0's agent closed it once done): nothing was lost.
        return End(exit_code=exitcodes.OK, reason="finished", line=None)
    if view.hosting:
        return Fail(message=f"lost the store on {view.store_address} (this agent's own store failed): stopping; "
                    f"start the job again to resume from its newest checkpoint ({e.error[:120]})",
                    exit_code=exitcodes.FAILED)
    if view.movable and view.state in (AgentState.STARTING, AgentState.RUNNING, AgentState.WAITING_FOR_NODE):
        return MoveStore(error=e.error)  # to the store's first successor alive (resilient_train.agent.succession)
    # Node 0's host gone and this node cut off look the same from here; cut off, the job may have declared this
    # node lost and given its ranks to a spare already: they must not run on (resilient_train.rank.fence).
    line = (f"lost the store on {view.store_address} (node 0's agent is gone or does not answer, or this node is "
            f"cut off from it: {e.error[:120]}): this node cannot know whether it was declared lost, so its ranks "
            f"are fenced out (exit code {exitcodes.FENCED}); if the job stopped, start it again to resume from its "
            "newest checkpoint")
    # e.fenced: a rank left FENCED first (it found its node declared lost, or lost the store itself).
    how = "its ranks left fenced; the store is gone since" if e.fenced else f"lost the store on {view.store_address}"
    if view.state is AgentState.WAITING_FOR_NODE:
        return End(exit_code=exitcodes.FENCED, reason="fenced", line=line)
    if view.state in (AgentState.STARTING, AgentState.RUNNING):
        return FenceNode(how=how, line=line)
    return Fail(message=line, exit_code=exitcodes.FENCED)  # its end was under way: nothing left to kill first


def _no_majority(view: View, e: NoMajority) -> Decision:
    """No successor opened a store with a majority: this side may be the one cut off (fenced, 94); with the
    host's process known dead, the job cannot go on here and stops to be resumed (75)."""
    if e.host_dead:
        return Fail(message=f"lost the store's host ({e.error[:120]}), and {e.reason}: stopping; start the job "
                    "again to resume from its newest checkpoint", exit_code=exitcodes.REQUEUE)
    line = (f"lost the store on {view.store_address} ({e.error[:120]}), and {e.reason}: this node may be the one cut "
            f"off, and cannot know whether it was declared lost, so its ranks are fenced out (exit code "
            f"{exitcodes.FENCED}); if the job stopped, start it again to resume from its newest checkpoint")
    if view.state is AgentState.WAITING_FOR_NODE:
        return End(exit_code=exitcodes.FENCED, reason="fenced", line=line)
    if view.state in (AgentState.STARTING, AgentState.RUNNING):
        return FenceNode(how=f"lost the store on {view.store_address}", line=line)
    return Fail(message=line, exit_code=exitcodes.FENCED)


RULES: dict[type, Callable[[View, Any], Decision]] = {
    WorkerExited: _worker_exited,
    RankHung: _rank_hung,
    StacksDue: lambda view, e: KillDumped(rank=e.rank),
    NodeLost: lambda view, e: ClaimNode(node=e.node, incarnation=e.incarnation),
    Signalled: _signalled,
    PeerStopping: lambda view, e: ShutDown(signum=e.signum, signalled=False),
    AllSucceeded: lambda view, e: Leave(exit_code=exitcodes.OK),
    SupervisedSeen: lambda view, e: EnableSpares(),
    SpareDue: lambda view, e: StartSpare(),
    StoreUnreachable: _store_lost,
    NoMajority: _no_majority,
    Fenced: _fenced,
    NodeAssigned: lambda view, e: TakeNode(node=e.node),
    JobEnded: _job_ended,
    MonitorStateDue: lambda view, e: SaveMonitorState(),
    MonitorStateOffered: lambda view, e: TakeOffer(),
    RunDirFailed: _run_dir_failed,
}
"""The rule for each kind of event: every kind has one (checked when this module loads)."""
assert set(RULES) == set(get_args(Event)), set(get_args(Event)) ^ set(RULES)
