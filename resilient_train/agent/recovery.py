"""What the agent does when one of its workers dies: replace it in place, or restart every worker.

A Supervisor rank is replaced in place: its generation is declared failed
(the survivors roll back to the last commit and wait at the next
generation's join) and the rank starts again with the same id, from a warm
spare, within ``--max-replacements``. A plain script gets torchrun's recovery
instead (RESTARTING): every worker is killed and started again on a fresh
store on the same port, within ``--max-restarts``; resilient_train.agent.restarts
says when the same crash again stops it, and whom to blame.
"""

from __future__ import annotations

import time
from typing import Callable

from monitors import EventLog
from resilient_train.agent.config import AgentConfig
from resilient_train.agent.events import RestartAll
from resilient_train.agent.hangs import HangPolicy
from resilient_train.agent.state import AgentLifecycle, AgentState
from resilient_train.agent.storehost import StoreHost
from resilient_train.agent.workers import Workers
from resilient_train.agent.restarts import WorkerFailure, RestartPolicy
from resilient_train.protocol.store import current_generation, declare_fault, interrupt_for_stop, request_stop

__all__ = ["WorkerRecovery"]

Spawn = Callable[[int, int, bool], None]  # (rank, generation, replacement)


class WorkerRecovery:
    def __init__(self, config: AgentConfig, lifecycle: AgentLifecycle, *, workers: Workers, hangs: HangPolicy,
                 host: StoreHost, events: EventLog, say: Callable[[str], None], spawn: Spawn) -> None:
        self.config, self.lifecycle, self.workers, self.hangs, self.host = config, lifecycle, workers, hangs, host
        self.events, self._say, self._spawn = events, say, spawn
        self.policy = RestartPolicy(config.max_restarts)
        self.replacements = 0  # in-place replacements of Supervisor ranks
        self.early_exits: set[tuple[int, int]] = set()  # (rank, step) of Supervisor ranks that left with 0 early

    @property
    def restarts(self) -> int:
        """Restarts of every worker plus in-place replacements."""
        return self.policy.restarts + self.replacements

    def cause(self, rank: int) -> dict:
        w = self.workers.get(rank)
        return (w.cause if w is not None else None) or {"kind": "exit"}

    def fault_detected(self, failure: WorkerFailure) -> None:
        """Reports a worker's death (first logging the stacks of a hung one that died while dumping them)."""
        w = self.workers.get(failure.rank)
        assert w is not None
        self.hangs.exited(w)
        self.events.emit("fault_detected", rank=w.rank, how=failure.how, pid=w.proc.pid,
                         generation=current_generation(self.host.store), summary=failure.summary,
                         **self.cause(w.rank))

    def attempt_failed(self, failure: WorkerFailure, followed: tuple[WorkerFailure, ...], decision: str) -> None:
        self.events.emit("attempt_failed", attempt=self.host.attempt, rank=failure.rank, how=failure.how,
                         kind=failure.kind, summary=failure.summary, followed=[o.rank for o in followed],
                         decision=decision)

    def replace(self, failure: WorkerFailure, *, step: int = -1) -> None:
        """A Supervisor rank died: its generation failed, and the rank starts again in place."""
        self.fault_detected(failure)
        if failure.kind == "early-exit":
            self.early_exits.add((failure.rank, step))
        self.replacements += 1
        store = self.host.store
        g = current_generation(store)
        declare_fault(store, g, {"rank": failure.rank, "kind": self.cause(failure.rank)["kind"], "how": failure.how,
                                 "time": time.time()}, world_size=self.config.world_size)
        self._spawn(failure.rank, current_generation(store), True)

    def stop_job(self, rank: int, *, exit_code: int, reason: str) -> None:
        """The agent stops the job itself: the stop key every rank and agent watches (first reason wins)."""
        request_stop(self.host.store, {"rank": rank, "summary": reason, "exit_code": exit_code,
                                       "step": -1, "generation": current_generation(self.host.store)})
        interrupt_for_stop(self.host.store, world_size=self.config.world_size)

    def restart_all(self, d: RestartAll) -> None:
        """torchrun's recovery, for scripts that do not use the supervisor (RESTARTING, then RUNNING)."""
        self.fault_detected(d.failure)
        decision = self.policy.decide(d.failure, reported_step=self.hangs.reported_step)
        self.attempt_failed(d.failure, d.followed, decision.value)
        c = self.config
        self._say(f"{d.blame}; restarting every worker (restart {self.policy.restarts} of {c.max_restarts})")
        self.events.emit("restart_all", reason=d.blame, attempt=self.host.attempt + 1)
        self.lifecycle.to(AgentState.RESTARTING)
        self.workers.kill_all()
        self.hangs.new_attempt()
        self.host.rehost()
        for rank in c.ranks():
            self._spawn(rank, 0, False)
        self.lifecycle.to(AgentState.RUNNING)
