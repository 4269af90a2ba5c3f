"""How this agent's part of the job ends: a shutdown (a signal, a preemption), a rank's stop, or success; leaving.

The shutdown's policy (one grace, the exit code from the ranks' records) is
resilient_train.protocol.shutdown's; here is the agent's sequence around it: forward
the signal, wait out the grace, SIGKILL the rest, say the verdict, and leave.
A rank killed while the job shuts down fails its generation, so that its peers stop
waiting for it. A rank's stop (STOPPING) gives the ranks a short grace to leave on their own.
Leaving (many nodes) tells the job this node is done; node 0's agent, which
hosts the store, waits for the others first. A store that is gone by then
changes nothing: the outcome was decided before.
"""

from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist

from monitors import EventLog
from resilient_train.base import exitcodes
from resilient_train.agent.config import AgentConfig
from resilient_train.agent.membership import Membership
from resilient_train.agent.state import AgentLifecycle, AgentState
from resilient_train.agent.workers import Workers
from resilient_train.protocol.shutdown import PLAIN_SHUTDOWN_TIMEOUT_S, Shutdown
from resilient_train.protocol.store import current_generation, declare_fault

__all__ = ["Ending", "STOP_GRACE_S"]

STOP_GRACE_S = 5.0  # a rank stopped the job: the others leave on their own within this, or are killed


class Ending:
    def __init__(self, config: AgentConfig, lifecycle: AgentLifecycle, *, workers: Workers, events: EventLog,
                 say: Callable[[str], None], membership: Membership | None, hosting: Callable[[], bool]) -> None:
        self.config, self.lifecycle, self.workers, self.events, self._say = config, lifecycle, workers, events, say
        self.membership, self.hosting = membership, hosting
        self.shutdown = self.new_shutdown()

    def new_shutdown(self) -> Shutdown:
        """The shutdown of this node's ranks (again when a spare takes a node: its ranks change)."""
        c = self.config
        timeout = PLAIN_SHUTDOWN_TIMEOUT_S if c.shutdown_timeout_s is None else c.shutdown_timeout_s
        self.shutdown = Shutdown(node=c.node_rank, nnodes=c.nnodes, ranks=c.ranks(), timeout_s=timeout,
                                 timeout_given=c.shutdown_timeout_s is not None)
        return self.shutdown

    def shut_down(self, store: dist.Store, signum: int | None, *, signalled: bool, restarts: int) -> int:
        """A signal (this node's, or another node's) or a preemption its ranks began: they get the grace, the
        rest is SIGKILLed, the exit code says what the ranks did, and the job hears that this node left."""
        self.lifecycle.to(AgentState.SHUTTING_DOWN)
        sd = self.shutdown
        sd.begin(store, signum, signalled=signalled)
        if signalled:
            self._say(sd.received_line())
        if signum is not None:
            self.workers.signal_all(signum)
        left = sd.wait(store, self.workers.procs,
                       died=(lambda rank, code: self._release_peers(store, rank, code)) if sd.supervised else None)
        if left:
            self.events.emit("shutdown_killed", ranks=left, grace_s=sd.grace_s, timeout_s=sd.timeout_s)
        self.workers.kill_all()
        verdict = sd.verdict(store, self.workers.exit_codes())
        if verdict.line is not None:
            self._say(verdict.line)
        self.events.emit("agent_end", ok=verdict.exit_code == 0, reason=verdict.reason, exit_code=verdict.exit_code,
                         restarts=restarts, step=verdict.step, checkpoint_committed=verdict.committed)
        if not sd.store_lost:
            self.leave(store, until=sd.leave_by)
        return self.lifecycle.end(verdict.exit_code, verdict.reason)

    def _release_peers(self, store: dist.Store, rank: int, code: int) -> None:
        """A rank died while the job shuts down (killed from outside as the signal came): its generation fails,
        as for any death, so that its peers stop waiting for it (a save in flight, a collective). No replacement
        comes: they stop in the next join, to be resumed (75)."""
        w = self.workers.get(rank)
        assert w is not None
        failure = self.workers.failure(w, code)  # as a death outside a shutdown is described
        try:
            g = current_generation(store)
            declare_fault(store, g, {"rank": rank, "kind": failure.kind, "how": failure.how, "time": time.time()},
                          world_size=self.config.world_size)
        except dist.DistError:
            return  # the store is gone: so are the waits on it
        self.events.emit("fault_detected", rank=rank, how=failure.how, generation=g, kind=failure.kind,
                         during="shutdown")

    def stop(self, store: dist.Store, *, exit_code: int, reason: str, restarts: int) -> int:
        """A rank stopped the job: the others leave on their own (they saw the stop key) or are killed."""
        self.lifecycle.to(AgentState.STOPPING)
        self.workers.stop(grace_s=STOP_GRACE_S)
        self.events.emit("agent_end", ok=False, reason=reason, exit_code=exit_code, restarts=restarts)
        self._say(f"job stopped: {reason} (exit code {exit_code})")
        self.leave(store)
        return self.lifecycle.end(exit_code, reason)

    def succeed(self, store: dist.Store, *, restarts: int) -> int:
        """Every worker of this node exited 0."""
        self.leave(store)
        self.events.emit("agent_end", ok=True, restarts=restarts)
        return self.lifecycle.end(0, "finished")

    def fence(self, how: str, *, restarts: int, line: str | None = None) -> int:
        """This node was declared lost while this agent lived, or lost the store and must assume it was
        (FENCED): its ranks go, and so does the agent, without a word to the job (the node is the spare's now,
        or its next agent's). ``line``: what to say, when not that the node was declared lost."""
        self.lifecycle.to(AgentState.FENCED)
        self.workers.kill_all()
        code = exitcodes.FENCED
        self._say(line or f"node {self.config.node_rank} was declared lost ({how}): its ranks are fenced out and "
                  f"the job goes on without this agent (exit code {code})")
        self.events.emit("agent_end", ok=False, reason="fenced", how=how, exit_code=code, restarts=restarts)
        return self.lifecycle.end(code, "fenced")

    def leave(self, store: dist.Store, *, until: float | None = None) -> None:
        """Many nodes: LEAVING (this node is done; node 0 waits for the others, ``until`` at most)."""
        if self.membership is None:
            return
        self.lifecycle.to(AgentState.LEAVING)
        try:
            self.membership.leave(store, hosting=self.hosting(), until=until)
        except dist.DistError:  # node 0's agent closed the store after its wait: nothing left to tell
            pass
