"""The agent's actions: each kind of decision (resilient_train.agent.decide) carried out by one function.

An action gets the agent (resilient_train.agent.loop.Agent) and the decision,
and does what the decision says with the agent's parts: its workers, its
recovery, its ending, its membership, its spares. :data:`ACTIONS` holds one
action for every kind of decision; a decision with none is a bug found when
this module loads, never at the moment the decision is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, get_args

import torch.distributed as dist

from monitors import EventLog
from resilient_train.agent import events as ev
from resilient_train.agent.clock import PauseClock
from resilient_train.agent.decide import View, decide
from resilient_train.agent.ending import Ending
from resilient_train.agent.entry import Entry
from resilient_train.agent.hangs import HangPolicy
from resilient_train.agent.membership import Membership
from resilient_train.agent.monitorstate import MonitorState
from resilient_train.agent.move import move_store
from resilient_train.agent.recovery import WorkerRecovery
from resilient_train.agent.spares import SparePool
from resilient_train.agent.state import AgentError, AgentLifecycle
from resilient_train.agent.storehost import StoreHost
from resilient_train.agent.workers import Workers, WorkerState

__all__ = ["ACTIONS", "Acting", "act"]


class Acting(Protocol):
    """What the actions use of the agent (resilient_train.agent.loop.Agent)."""

    workers: Workers
    events: EventLog
    recovery: WorkerRecovery
    ending: Ending
    hangs: HangPolicy
    membership: Membership | None
    spares: SparePool | None
    persist: MonitorState
    lifecycle: AgentLifecycle
    host: StoreHost
    entry: Entry
    clock: PauseClock
    announce_to: Path

    @property
    def store(self) -> dist.Store: ...

    @property
    def restarts(self) -> int: ...

    def view(self) -> View: ...

    def say(self, line: str) -> None: ...

    def take_node(self, node: int) -> None: ...


def act(agent: Acting, d: ev.Decision) -> None:
    """Carries out one decision."""
    ACTIONS[type(d)](agent, d)


def _mark_succeeded(agent: Acting, d: ev.MarkSucceeded) -> None:
    w = agent.workers.get(d.rank)
    assert w is not None
    w.state = WorkerState.SUCCEEDED
    if d.after_final is not None:  # the final state is committed: the run is over whatever happens now
        agent.events.emit("worker_exit_after_final", rank=d.rank, how=d.after_final.how)


def _stop_job(agent: Acting, d: ev.StopJob) -> None:
    if d.rank >= 0:
        agent.events.emit("worker_stopped_job", rank=d.rank, exit_code=d.rc, reason=d.reason)
    if d.request:  # the agent's own verdict: every rank, on every node, learns it from the store
        agent.recovery.stop_job(d.rank, exit_code=d.exit_code, reason=d.reason)
    agent.ending.stop(agent.store, exit_code=d.exit_code, reason=d.reason, restarts=agent.restarts)


def _shut_down(agent: Acting, d: ev.ShutDown) -> None:
    if d.preempted_rank is not None:
        agent.events.emit("worker_preempted", rank=d.preempted_rank)
    agent.ending.shut_down(agent.store, d.signum, signalled=d.signalled, restarts=agent.restarts)


def _fail(agent: Acting, d: ev.Fail) -> None:
    if d.failure is not None:
        agent.recovery.fault_detected(d.failure)
    if d.restart_decision is not None:
        assert d.failure is not None
        agent.recovery.attempt_failed(d.failure, d.followed, d.restart_decision)
    raise AgentError(d.message, exit_code=d.exit_code)


def _kill(agent: Acting, d: ev.Kill) -> None:
    w = agent.workers.get(d.rank)
    assert w is not None
    agent.hangs.kill(w, d.cause, dump_stacks=d.dump_stacks)


def _kill_dumped(agent: Acting, d: ev.KillDumped) -> None:
    w = agent.workers.get(d.rank)
    assert w is not None
    agent.hangs.kill_dumped(w)


def _claim_node(agent: Acting, d: ev.ClaimNode) -> None:
    assert agent.membership is not None
    agent.membership.handle_loss(agent.store, d.node, d.incarnation)


def _end(agent: Acting, d: ev.End) -> None:
    if d.line is not None:
        agent.say(d.line)
    extra = {"spare_unused": True} if d.spare_unused else {}
    agent.events.emit("agent_end", ok=d.exit_code == 0, reason=d.reason, exit_code=d.exit_code,
                      restarts=agent.restarts, **extra)
    agent.lifecycle.end(d.exit_code, d.reason)


def _enable_spares(agent: Acting, d: ev.EnableSpares) -> None:
    assert agent.spares is not None
    agent.spares.enable()


def _start_spare(agent: Acting, d: ev.StartSpare) -> None:
    assert agent.spares is not None
    agent.spares.start_next()


def _move_store(agent: Acting, d: ev.MoveStore) -> None:
    assert agent.membership is not None  # decided only by an agent that knows the store's succession
    failed = move_store(d.error, host=agent.host, membership=agent.membership, path=agent.announce_to,
                        events=agent.events, say=agent.say, supervised=agent.entry.mentions_runtime(),
                        clock=agent.clock)
    if failed is not None:
        act(agent, decide(agent.view(), failed))


ACTIONS: dict[type, Callable[[Acting, Any], None]] = {
    ev.Ignore: lambda agent, d: None,
    ev.MarkSucceeded: _mark_succeeded,
    ev.StopJob: _stop_job,
    ev.ShutDown: _shut_down,
    ev.Replace: lambda agent, d: agent.recovery.replace(d.failure, step=d.step),
    ev.RestartAll: lambda agent, d: agent.recovery.restart_all(d),
    ev.Fail: _fail,
    ev.Kill: _kill,
    ev.KillDumped: _kill_dumped,
    ev.ClaimNode: _claim_node,
    ev.Leave: lambda agent, d: agent.ending.succeed(agent.store, restarts=agent.restarts),
    ev.End: _end,
    ev.FenceNode: lambda agent, d: agent.ending.fence(d.how, restarts=agent.restarts, line=d.line),
    ev.EnableSpares: _enable_spares,
    ev.StartSpare: _start_spare,
    ev.SaveMonitorState: lambda agent, d: agent.persist.save(),
    ev.TakeOffer: lambda agent, d: agent.persist.take_offer(),
    ev.TakeNode: lambda agent, d: agent.take_node(d.node),
    ev.MoveStore: _move_store,
}
"""The action for each kind of decision: every kind has one (checked when this module loads)."""
assert set(ACTIONS) == set(get_args(ev.Decision)), set(get_args(ev.Decision)) ^ set(ACTIONS)
