"""The node agent behind ``resilient-train run``: its policies composed, and the one loop that drives them.

It hosts the coordination store (so any rank, rank 0 included, may die),
spawns one worker per local rank with torchrun's environment, and watches
them. A supervised worker that dies is replaced in place: the agent declares
its generation failed (the survivors roll back and wait) and hands the rank to
a warm spare. A script that does not use the supervisor gets torchrun's
behaviour instead: every worker is restarted, within ``--max-restarts``, on a
fresh store on the same port (resilient_train.agent.restarts says when it stops
early, and whom it blames). Every worker's output passes through the agent
(resilient_train.agent.workerio).

Each policy is a module of this package (the store, the workers, hangs,
monitor state, many nodes, signals, the ending); each poller returns events
(resilient_train.agent.events), :func:`~resilient_train.agent.decide.decide`
turns each into one decision, and :meth:`Agent._act` carries it out, moving
the agent's one state value (resilient_train.agent.state) as it goes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterable

import torch.distributed as dist

from monitors import EventLog, NodeMonitor
from monitors.dashboard.server import DashboardServer
from resilient_train.agent import events as ev
from resilient_train.agent.clock import PauseClock
from resilient_train.agent.config import AgentConfig
from resilient_train.agent.act import act
from resilient_train.agent.decide import View, decide
from resilient_train.agent.ending import Ending
from resilient_train.agent.hangs import HangPolicy
from resilient_train.agent.membership import Membership
from resilient_train.agent.monitorstate import MonitorState
from resilient_train.agent.move import announce_path, store_env
from resilient_train.agent.recovery import WorkerRecovery
from resilient_train.agent.rundirwatch import RunDirWatch
from resilient_train.agent.signals import SignalTrap
from resilient_train.agent.startwords import start_lines
from resilient_train.agent.state import AgentError, AgentLifecycle, AgentState
from resilient_train.agent.storehost import StoreHost
from resilient_train.agent.workers import Workers
from resilient_train.protocol import env as E
from resilient_train.base import exitcodes
from resilient_train.agent.entry import Entry
from resilient_train.agent.rundir import RunDirError, take_run_dir
from resilient_train.agent.slurmenv import slurm_job
from resilient_train.agent.spares import SparePool, spare_env, spares_wanted
from resilient_train.protocol.store import Keys
from resilient_train.agent.console import Console, Std

__all__ = ["Agent"]

Poller = Callable[[], Iterable[ev.Event]]


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = c = config
        if config.entry is None:
            raise ValueError("no script to run (give SCRIPT, or agent.script in the run config)")
        self.entry: Entry = config.entry
        self.run_dir = Path(config.run_dir)
        self.lifecycle = AgentLifecycle()
        hosting = c.node_rank == 0 and not c.spare
        # Private to its owner, no links where the runtime writes, and locked for this job's life:
        # a second job on the same run directory is refused (resilient_train.agent.rundir).
        lock = ".lock" if hosting or c.nnodes == 1 else (f".lock.spare-{os.getpid()}" if c.spare
                                                         else f".lock.node{c.node_rank}")
        try:
            self._run_dir_lock = take_run_dir(self.run_dir, name=lock)
        except RunDirError as e:
            raise AgentError(str(e)) from None
        self._dashboard: DashboardServer | None = None
        if c.dashboard is not None:
            try:  # binds now, before anything else starts: a port in use is bad input
                self._dashboard = DashboardServer(self.run_dir, c.dashboard)
            except ValueError as e:
                raise AgentError(str(e)) from None
        self.console = Console()
        # Its warnings on the console, in order with the agent's lines (the job's verdict stays the last one).
        self.events = EventLog(self.run_dir / "events.jsonl", source=c.source, say=self.say)
        self.console.on_closed = self._console_closed
        self.host = StoreHost(c)
        self.hangs = HangPolicy(c.monitor, self.run_dir, events=self.events, say=self.say)
        self.persist = MonitorState(self.run_dir, every_s=c.monitor_state_every_s, events=self.events, say=self.say)
        self._watch_node(waiting=c.spare)
        self.membership = Membership(c, events=self.events, say=self.say, token=self.host.token,
                                     succession=self.host.succession, endpoint=lambda: self.host.endpoint) \
            if self.host.succession is not None else None
        self.announce_to = announce_path(self.run_dir)  # where this node's ranks learn that the store moved
        self.workers = Workers(c, self.entry, run_dir=self.run_dir, events=self.events, console=self.console)
        self.recovery = WorkerRecovery(c, self.lifecycle, workers=self.workers, hangs=self.hangs, host=self.host,
                                 events=self.events, say=self.say,
                                 spawn=lambda rank, g, replacement: self._spawn(rank, g, replacement=replacement))
        self.spares = self._spare_pool()
        self.signals = SignalTrap(c.signals, self.console)
        self.clock = PauseClock(on_pause=self._excuse)
        self.run_dir_watch = RunDirWatch(self.run_dir)
        self.ending = Ending(c, self.lifecycle, workers=self.workers, events=self.events, say=self.say,
                             membership=self.membership, hosting=lambda: self.host.hosting)

    # ------------------------------------------------------------ the view
    @property
    def state(self) -> AgentState:
        return self.lifecycle.state

    @property
    def store(self) -> dist.Store:
        return self.host.store

    @property
    def port(self) -> int:
        return self.host.port

    @property
    def monitor(self) -> NodeMonitor:
        assert self.hangs.monitor is not None
        return self.hangs.monitor

    @property
    def restarts(self) -> int:
        """Restarts of every worker plus in-place replacements."""
        return self.recovery.restarts

    def view(self) -> View:
        c = self.config
        movable = not self.host.hosting and self.host.succession is not None and self.host.succession.known is not None
        return View(state=self.state, nnodes=c.nnodes, hosting=self.host.hosting, store_address=self.host.address,
                    movable=movable,
                    pids={w.rank: w.proc.pid for w in self.workers},
                    killing=frozenset(w.rank for w in self.workers if w.cause is not None),
                    replacements=self.recovery.replacements, max_replacements=c.max_replacements,
                    early_exits=frozenset(self.recovery.early_exits),
                    max_restarts=c.max_restarts, attempt=self.host.attempt, restart_policy=self.recovery.policy,
                    reported_step=self.hangs.reported_step, finished=self.workers.all_succeeded())

    # ------------------------------------------------------------- the run
    def run(self) -> int:
        c = self.config
        # Under Slurm: the job id and SLURM_RESTART_COUNT, so each start of a requeued job is told apart.
        self.events.emit("agent_start", world_size=c.world_size, port=self.port, script=self.entry.target,
                         entry=self.entry.kind.value, args=c.script_args, **slurm_job(os.environ))
        for line in start_lines(c, self.entry, omp_default=self.workers.omp_default, fd_warning=self.host.fd_warning):
            self.say(line)
        if self._dashboard is not None:
            self._dashboard.start()
        if self.entry.mentions_runtime() and self.spares is not None:
            # A Supervisor job: the first spare starts beside the ranks (the loop's first look, once they are
            # spawned), not before them: waiting for its import delayed every job's first step by that import
            # (2.2 s on 2 cores); a rank lost before it is ready still takes it and waits out the rest of it.
            # A spare node has no ranks yet: it warms its spares while it waits.
            self.spares.enable()
        self.signals.install()
        try:
            self._guarded(self._begin)
            while not self.state.terminal:
                self._guarded(self._look)
                if not self.state.terminal:
                    time.sleep(c.monitor_interval_s)
            assert self.lifecycle.exit_code is not None
            return self.lifecycle.exit_code
        except AgentError as e:
            self.lifecycle.fail(e)
            self.events.emit("agent_end", ok=False, reason=str(e), exit_code=e.exit_code, restarts=self.restarts)
            raise
        finally:
            self.signals.restore()
            self.close()

    def _begin(self) -> None:
        if self.config.spare:
            assert self.membership is not None
            self.lifecycle.to(AgentState.WAITING_FOR_NODE)
            self.membership.wait_as_spare(self.store, self.host.connect)
        else:
            self._start_node()

    def _guarded(self, step: Callable[[], None]) -> None:
        """Runs one step of the loop; a store that fails under it is one more event (StoreUnreachable)."""
        try:
            step()
        except dist.DistError as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
            codes = [w.proc.poll() for w in self.workers]  # how this node's part ended, if it did
            act(self, decide(self.view(), ev.StoreUnreachable(error=error, finished=bool(codes) and set(codes) == {0},
                                                       fenced=exitcodes.FENCED in codes)))

    def _look(self) -> None:
        """One look at everything this state watches: each event is decided and acted on as it comes."""
        self.clock.tick()
        for poller in self._pollers():
            for event in poller():
                act(self, decide(self.view(), event))
                if self.state.terminal:
                    return

    def _excuse(self, paused_s: float) -> None:
        """The agent did not run for ``paused_s`` (agent.clock): not charged to the ranks or the other nodes."""
        now = time.monotonic()
        if self.hangs.monitor is not None:
            self.hangs.monitor.hangs.paused(now)
        if self.membership is not None:
            self.membership.excuse(now)
        self.events.emit("agent_paused", seconds=round(paused_s, 3))

    def _pollers(self) -> list[Poller]:
        if self.state is AgentState.WAITING_FOR_NODE:
            return [self.signals.poll, self._poll_assignment, self._poll_spares]
        return [self.signals.poll, self.run_dir_watch.poll, self._poll_peers,
                lambda: self.workers.poll(self.store, self.hangs.step_of),
                lambda: self.hangs.poll(list(self.workers)), self.persist.poll, self._poll_nodes,
                self._poll_supervised, self._poll_spares,
                lambda: [ev.AllSucceeded()] if self.workers.all_succeeded() else []]

    # ------------------------------------------------------------- pollers
    def _poll_peers(self) -> list[ev.PeerStopping]:
        signum = self.ending.shutdown.stopping(self.store)  # another node's agent was signalled
        return [] if signum is None else [ev.PeerStopping(signum=signum, node=self.ending.shutdown.from_node)]

    def _poll_nodes(self) -> list[ev.NodeLost | ev.Fenced]:
        return self.membership.poll(self.store, hosting=self.host.hosting) if self.membership is not None else []

    def _poll_assignment(self) -> list[ev.NodeAssigned | ev.JobEnded]:
        assert self.membership is not None
        return self.membership.poll_assignment(
            self.store, stopping=lambda: self.ending.shutdown.stopping(self.store) is not None)

    def _poll_supervised(self) -> list[ev.SupervisedSeen]:
        """Spares are for Supervisor jobs: the first rank that registers with one starts the spare."""
        if self.spares is None or self.spares.enabled:
            return []
        return [ev.SupervisedSeen()] if any(self.store.check([Keys.supervised(w.rank)]) for w in self.workers) else []

    def _poll_spares(self) -> list[ev.SpareDue]:
        if self.spares is None:
            return []
        self.spares.note()
        return [ev.SpareDue()] if self.spares.due() else []

    # ------------------------------------------------------- node and spawn
    def _start_node(self) -> None:
        """Starts this node's ranks (registered first, many nodes): replacements when the job already ran
        without them (the node comes back, or a spare took it)."""
        returning, generation = (self.membership.enter(self.store, self.host.connect) if self.membership is not None
                                 else (False, 0))
        for rank in self.config.ranks():
            self._spawn(rank, generation, replacement=returning)
        if self.spares is not None:
            # A spare node's ranks took its spares.
            self.spares.resize(spares_wanted(self.config.spares, self.config.nproc_per_node, waiting=False))
        self.lifecycle.to(AgentState.RUNNING)

    def take_node(self, node: int) -> None:
        """A spare node's agent becomes node ``node``."""
        assert self.membership is not None
        self.config.node_rank = node
        self.ending.new_shutdown()
        self._watch_node(waiting=False)
        self.membership.take(node)
        self.lifecycle.to(AgentState.STARTING)
        self._start_node()

    def _watch_node(self, *, waiting: bool) -> None:
        """This node's hang and straggler monitor (of no rank for a spare still ``waiting``), its state loaded."""
        c = self.config
        monitor = self.hangs.watch(() if waiting else c.ranks(), store=self.store if c.nnodes > 1 and not waiting
                                   else None, node=c.node_rank, nnodes=c.nnodes, node_timeout_s=c.node_timeout_s)
        self.persist.attach(monitor, c.node_rank)

    def _env(self, rank: int, generation: int, replacement: bool, error_file: Path | None) -> dict[str, str]:
        h, m = self.host, self.membership
        # Many nodes: where the store is now; the rank's node and this agent's incarnation of it (the fence).
        node = store_env(h, self.announce_to, self.config.node_timeout_s) if m is not None else {}
        node.update({E.RT_NODE: str(self.config.node_rank), E.RT_NODE_INCARNATION: str(m.incarnation)}
                    if m is not None and m.incarnation > 0 else {})
        return self.workers.env(rank, generation, replacement=replacement, port=h.port, token=h.token,
                                attempt=h.attempt, error_file=error_file, extra=node)

    def _spawn(self, rank: int, generation: int, *, replacement: bool) -> None:
        self.hangs.expect(rank, had_worker=self.workers.get(rank) is not None)
        self.workers.spawn(rank, generation, replacement=replacement, attempt=self.host.attempt,
                           env_for=lambda error_file: self._env(rank, generation, replacement, error_file),
                           spares=self.spares)

    def _spare_pool(self) -> SparePool | None:
        """The warm spares (resilient_train.agent.spares), each with this node's worker environment."""
        c = self.config
        if not c.warm_spare or c.spares == 0 or self.entry.python_argv is None:
            return None

        def env_for(slot: int) -> dict[str, str]:
            local = slot % c.nproc_per_node  # spares differ per local rank only with --virtual-local-rank
            return spare_env(self._env(c.first_rank + local, 0, False, None))

        return SparePool(self.entry, c.script_args, env_for=env_for, emit=self.events.emit,
                         size=spares_wanted(c.spares, c.nproc_per_node, waiting=c.spare))

    # -------------------------------------------------------------- words
    def say(self, line: str) -> None:
        self.console.write(f"resilient-train: {line}\n".encode())

    def _console_closed(self, std: Std) -> None:
        """A console reader went (``| head``): the ranks go on, their output to their log files (workerio)."""
        name = "stdout" if std is Std.OUT else "stderr"
        where = str(self.workers.log_dir / "attempt_N" / "LOCAL_RANK" / f"{name}.log")
        self.events.emit("console_closed", stream=name, output=where)
        self.say(f"{name} is closed (its reader exited): the job goes on; the ranks' {name} goes to {where}")

    def close(self) -> None:
        if self.membership is not None:
            self.membership.close()
        if self._dashboard is not None:
            self._dashboard.close()
        self.workers.close()
        if AgentState.FENCED not in self.lifecycle.history:  # fenced: the node's monitor state is another agent's
            self.persist.save()
        self.hangs.close()
        if self.spares is not None:
            self.spares.close()
        self.host.close()
