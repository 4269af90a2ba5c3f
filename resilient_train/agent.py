"""The node agent behind ``resilient-train run``.

It hosts the coordination store (so any rank, rank 0 included, may die),
spawns one worker per local rank with torchrun's environment, and watches
them. A supervised worker that dies is replaced in place: the agent declares
its generation failed (the survivors roll back and wait) and hands the rank to
a warm spare. A script that does not use the supervisor gets torchrun's
behaviour instead: every worker is restarted, within ``--max-restarts``, on a
fresh store on the same port (resilient_train.restarts says when it stops
early, and whom it blames). Every worker's stderr passes through the agent
(resilient_train.workerio).
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import torch.distributed as dist

from monitors import EventLog, MonitorConfig, NodeMonitor
from monitors.dashboard.server import DashboardConfig, DashboardServer, DashboardUnavailable
from monitors.dashboard.server import check_available as check_dashboard
from monitors.jobwide import JobWideBest
from monitors.persist import monitor_state_path, offered_state_path, take_offer
from monitors.stacks import DUMP_WAIT_S, StackDumps
from resilient_train import env as E
from resilient_train.entry import Entry, EntryKind
from resilient_train.jobtoken import check_fingerprint, publish_fingerprint, shared_token
from resilient_train.nodes import Heartbeat, NodeKeys, NodeWatch, assign_spare, claim_loss, register_node, register_spare, wait_for_assignment
from resilient_train.restarts import Decision, ExitClock, Failure, RestartPolicy
from resilient_train.workerio import Console, OutputConfig, WorkerOutput
from resilient_train.rerun.policy import EXIT_VALIDATION_FAILED
from resilient_train.rundir import RunDirError, take_run_dir
from resilient_train.spares import SparePool, SpareState, die_with_parent, spare_env
from resilient_train import exitcodes
from resilient_train.shutdown import PLAIN_SHUTDOWN_TIMEOUT_S, Shutdown, check_seconds
from resilient_train.store import Keys, attempt_store, current_generation, declare_fault, job_store, new_token, read_stop

__all__ = ["Agent", "AgentConfig", "AgentError", "AgentStopped", "WorkerState"]


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


class WorkerState(str, Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(kw_only=True)
class AgentConfig:
    script: str = ""  # shorthand for entry=Entry(kind=SCRIPT, target=script)
    entry: Entry | None = None
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (kept for every attempt either way)
    fixed_port: bool = False  # the user gave the port
    run_id: str = "none"  # TORCHELASTIC_RUN_ID (--rdzv-id)
    role: str = "default"  # ROLE_NAME
    run_dir: str = "runs/latest"
    max_restarts: int = 0  # restarts of every worker (torchrun's meaning and default)
    max_replacements: int = 10  # in-place replacements of dead Supervisor ranks
    warm_spare: bool = True  # only for scripts that use the Supervisor
    spares: int | None = None  # warm spares kept (None: 1; a spare node waiting: one per local rank)
    monitor_interval_s: float = 0.05
    monitor_state_every_s: float = 5.0  # how often the computed hang timeouts are saved to the run directory
    chaos: str = ""  # JSON list of faults for the workers (chaos.dumps_faults)
    env: dict[str, str] = field(default_factory=dict)
    output: OutputConfig = field(default_factory=OutputConfig)
    signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")  # forwarded to the workers
    # After a forwarded signal, then SIGKILL (None: torchrun's 30 s); a Supervisor job follows its ranks'
    # preemption grace instead (resilient_train.shutdown).
    shutdown_timeout_s: float | None = None
    virtual_local_rank: bool = False
    spare: bool = False  # a spare node's agent: it waits, then takes over a lost node (resilient_train.nodes)
    node_timeout_s: float = 10.0  # a node whose agent has not beaten for this long is lost
    job_token_file: str | None = None  # many nodes: the file holding the job's secret (resilient_train.jobtoken)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)  # hangs, stragglers, metrics
    dashboard: DashboardConfig | None = None  # serve the live dashboard (monitors.dashboard) while the job runs

    def __post_init__(self) -> None:
        if self.entry is None:
            if not self.script:
                raise ValueError("no script to run")
            self.entry = Entry(kind=EntryKind.SCRIPT, target=self.script)
        self.script = self.script or self.entry.target
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("--nnodes > 1 needs the store's port: --master-port P (or --rdzv-endpoint HOST:PORT)")
        if self.spare and self.nnodes == 1:
            raise ValueError("--spare is for a many-node job (--nnodes > 1)")
        if self.node_timeout_s <= 0:
            raise ValueError(f"--node-timeout must be > 0, got {self.node_timeout_s}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port must be in [0, 65535], got {self.master_port}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.spares is not None and not 0 <= self.spares <= 64:
            raise ValueError(f"--spares must be in [0, 64], got {self.spares}")
        if self.max_replacements < 0:
            raise ValueError(f"--max-replacements must be >= 0, got {self.max_replacements}")
        if self.monitor_interval_s <= 0:
            raise ValueError(f"--monitor-interval must be > 0, got {self.monitor_interval_s}")
        if self.shutdown_timeout_s is not None:
            check_seconds(self.shutdown_timeout_s, "--shutdown-timeout", zero_ok=True)
        if self.entry.kind is EntryKind.SCRIPT and not Path(self.entry.target).is_file():
            raise ValueError(f"script {self.entry.target!r} does not exist")
        if self.dashboard is not None:
            try:
                check_dashboard()  # a missing extra is bad input, said before anything starts
            except DashboardUnavailable as e:
                raise ValueError(str(e)) from None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    generation: int
    output: WorkerOutput
    state: WorkerState = WorkerState.RUNNING
    cause: dict | None = None  # set when the agent killed it (a hang, a straggler)
    kill_at: float | None = None  # a hung rank dumping its stacks: SIGKILL at this monotonic time


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        assert config.entry is not None
        self.entry: Entry = config.entry
        self.run_dir = Path(config.run_dir)
        self._hosting = config.node_rank == 0 and not config.spare  # node 0's agent hosts the store
        self._check_run_dir()
        self._dashboard: DashboardServer | None = None
        if config.dashboard is not None:
            try:  # binds now, before anything else starts: a port in use is bad input
                self._dashboard = DashboardServer(self.run_dir, config.dashboard)
            except ValueError as e:
                raise AgentError(str(e)) from None
        self.events = EventLog(self.run_dir / "events.jsonl", source=self._source())
        self._stacks = StackDumps(self.run_dir)
        self._attempt = 0  # whole-group restarts (unsupervised scripts)
        self._server: dist.Store | None = None
        self._token, self._token_source = job_token(config)
        if self._hosting:
            self.store = self._host_store(config.master_port)
            self.port = self._server.port  # type: ignore[union-attr]  (every attempt keeps it)
        else:
            self.store = self._connect_store()
            self.port = config.master_port
            try:  # the same secret as node 0's, or nothing this node writes would be read
                check_fingerprint(self._server, self._token, source=self._token_source)  # type: ignore[arg-type]
            except ValueError as e:
                raise AgentError(str(e)) from None
        self._monitor_for(config.node_rank, waiting=config.spare)
        self._nodes = NodeWatch(self.store, config.node_rank, config.nnodes, config.node_timeout_s)
        self._handled_losses: set[tuple[int, int]] = set()
        self._heartbeat: Heartbeat | None = None
        self.workers: dict[int, _Worker] = {}
        self.replacements = 0
        self.policy = RestartPolicy(config.max_restarts)
        self.console = Console()
        self._log_dir = Path(config.output.log_dir) if config.output.log_dir else self.run_dir / "logs"
        self._exits = ExitClock()
        self._waiting = config.spare  # a spare node's agent that has no node yet
        self._spares = self._spare_pool()
        self._supervised_seen = False  # a rank registered with the Supervisor: the job uses spares
        self._stop_code: int | None = None  # a worker asked the whole job to stop with this code
        self._stop_reason: str | None = None
        self._signal: int | None = None  # a signal to forward to the workers (config.signals)
        self._attempt_step = -1  # the highest step any rank of this attempt reported
        self._offer_taken = False  # a checkpoint's monitor state was merged (monitors.persist)
        self._shutdown = self._new_shutdown()

    def _new_shutdown(self) -> Shutdown:
        c = self.config
        first = c.node_rank * c.nproc_per_node
        timeout = PLAIN_SHUTDOWN_TIMEOUT_S if c.shutdown_timeout_s is None else c.shutdown_timeout_s
        return Shutdown(node=c.node_rank, nnodes=c.nnodes, ranks=range(first, first + c.nproc_per_node),
                        timeout_s=timeout, timeout_given=c.shutdown_timeout_s is not None)

    def _source(self) -> str:
        c = self.config
        return "agent" if c.nnodes == 1 else ("agent-spare" if c.spare else f"agent{c.node_rank}")

    def _monitor_for(self, node_rank: int, *, waiting: bool = False) -> None:
        """The hang and straggler monitor of this node's ranks (none for a spare still ``waiting`` for a node)."""
        c = self.config
        first = node_rank * c.nproc_per_node
        # Many nodes: straggler scores against the whole job's fastest rank, shared through the store.
        peers = (JobWideBest(self.store, node=node_rank, nnodes=c.nnodes,
                             stale_after_s=3 * c.monitor.straggler.report_interval_s + c.node_timeout_s)
                 if c.nnodes > 1 and not waiting else None)
        self.monitor = NodeMonitor(c.monitor, self.run_dir, () if waiting else range(first, first + c.nproc_per_node),
                                   events=EventLog(self.run_dir / "events.jsonl", source="monitor"), peers=peers)
        # The computed hang timeouts outlive the agent: a job restarted in this run directory keeps them.
        self._monitor_state = monitor_state_path(self.run_dir)
        if node_rank > 0:
            self._monitor_state = self._monitor_state.with_name(f"timeouts-node{node_rank}.json")
        try:
            if self.monitor.load_state(self._monitor_state) is not None:
                self.events.emit("monitor_state_loaded", path=str(self._monitor_state), source="run directory",
                                 timeouts_s=self.monitor.state_dict()["hang"]["timeouts_s"])
        except ValueError as e:  # a forged or stale file: the detector keeps its defaults, and says so once
            self.events.emit("monitor_state_ignored", path=str(self._monitor_state), reason=str(e))
            print(f"resilient-train: saved hang timeouts ignored: {e}", file=sys.stderr, flush=True)
        self._monitor_saved_at = time.monotonic()

    @property
    def restarts(self) -> int:
        """Restarts of every worker plus in-place replacements."""
        return self.policy.restarts + self.replacements

    def _check_run_dir(self) -> None:
        # Private to its owner, no links where the runtime writes, and locked for this job's life:
        # a second job on the same run directory is refused (resilient_train.rundir).
        c = self.config
        name = ".lock" if self._hosting or c.nnodes == 1 else (f".lock.spare-{os.getpid()}" if c.spare
                                                               else f".lock.node{c.node_rank}")
        try:
            self._run_dir_lock = take_run_dir(self.run_dir, name=name)
        except RunDirError as e:
            raise AgentError(str(e)) from None

    def _host_store(self, port: int) -> dist.Store:
        """Hosts a fresh store on ``--master-addr`` only (loopback by default), under a fresh secret namespace.

        A restart gets a fresh store on the same port: the last attempt's keys (its
        process group's among them) must not be met again, and a script that was
        given a port keeps it.
        """
        addr = self.config.master_addr
        try:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
            sock.listen(4096)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AgentError(f"port {port} is already in use (pick another --master-port, or 0 for a free one)") from None
            raise AgentError(f"cannot host the coordination store on {addr}:{port}: {e.strerror or e}") from None
        try:
            store = dist.TCPStore(addr, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=60), master_listen_fd=sock.detach(), use_libuv=False)
        except (RuntimeError, OSError) as e:
            raise AgentError(f"cannot host the coordination store on port {port}: {str(e).splitlines()[0]}") from None
        self._server = store  # keeps the server alive; the agent itself talks through an attempt's keys
        if self.config.nnodes == 1:
            self._token = new_token()  # a fresh secret namespace each attempt
        else:
            publish_fingerprint(store, self._token)
        view = attempt_store(job_store(store, self._token), self._attempt)
        view.set(Keys.GENERATION, "0")
        return view

    def _connect_store(self) -> dist.Store:
        """A client of node 0's store, in the job's namespace (another node's agent; a heartbeat)."""
        c = self.config
        try:
            store = dist.TCPStore(c.master_addr, self.port if self._hosting else c.master_port, is_master=False,
                                  timeout=timedelta(seconds=60))
        except (RuntimeError, OSError) as e:
            raise AgentError(f"cannot reach the store on {c.master_addr}:{c.master_port} (node 0's agent): "
                             f"{str(e).splitlines()[0]}") from None
        if self._server is None:
            self._server = store
        return attempt_store(job_store(store, self._token), self._attempt)

    def _rehost_store(self) -> None:
        """The next attempt's store, on the same port (the old server is closed first)."""
        # Every reference to the old server goes first, or the port is still taken.
        self.store = self._server = self._nodes = None  # type: ignore[assignment]
        gc.collect()
        self.store = self._host_store(self.port)
        self._nodes = NodeWatch(self.store, self.config.node_rank, self.config.nnodes, self.config.node_timeout_s)

    # ---------------------------------------------------------------- spawn
    def _worker_env(self, rank: int, generation: int, replacement: bool, error_file: Path | None) -> dict[str, str]:
        c = self.config
        local = rank - c.node_rank * c.nproc_per_node
        env = dict(os.environ)
        env.update(c.env)
        env.update({
            E.RANK: str(rank), E.LOCAL_RANK: str(local),
            E.WORLD_SIZE: str(c.world_size), E.LOCAL_WORLD_SIZE: str(c.nproc_per_node),
            E.GROUP_RANK: str(c.node_rank), "GROUP_WORLD_SIZE": str(c.nnodes),
            "ROLE_RANK": str(rank), "ROLE_NAME": c.role, "ROLE_WORLD_SIZE": str(c.world_size),
            E.MASTER_ADDR: c.master_addr, E.MASTER_PORT: str(self.port),
            E.TORCHELASTIC_USE_AGENT_STORE: "True", E.TORCHELASTIC_RESTART_COUNT: str(self._attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(c.max_restarts), E.TORCHELASTIC_RUN_ID: c.run_id,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            E.RT_AGENT: "1", E.RT_RUN_DIR: str(self.run_dir.resolve()), E.RT_GENERATION: str(generation),
            E.RT_ROLE: "replacement" if replacement else "initial", E.RT_CHAOS: c.chaos,
            E.RT_JOB_TOKEN: self._token,
        })
        if error_file is not None:
            env["TORCHELASTIC_ERROR_FILE"] = str(error_file.resolve())
        if self._omp_default:
            env["OMP_NUM_THREADS"] = "1"  # torchrun's default (announced once at start)
        if c.virtual_local_rank:
            env[E.LOCAL_RANK] = "0"
            env["CUDA_VISIBLE_DEVICES"] = str(local)
        if c.master_addr in ("127.0.0.1", "localhost", "::1"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets on loopback too
        return env

    def _spawn(self, rank: int, generation: int, *, replacement: bool) -> None:
        c = self.config
        local = rank - c.node_rank * c.nproc_per_node
        output = WorkerOutput(rank=rank, local_rank=local, attempt=self._attempt, config=c.output,
                              console=self.console, log_dir=self._log_dir)
        env = self._worker_env(rank, generation, replacement, output.error_file)
        env[E.RT_SPAWNED_AT] = repr(time.time())
        # Before the worker can start: a warm spare creates its progress slot at once, and a slot that
        # exists when the detector is reset is taken for the dead worker's and never watched. A rank
        # whose predecessor reported progress is watched from its spawn (a replacement stuck starting).
        old = self.workers.get(rank)
        reported = old is not None and self.monitor.hangs.last.get(rank) is not None
        self.monitor.reset(rank, expect_progress=reported)
        # The spare is kept for replacements, where its head start counts.
        spare = self._spares.take(env) if replacement and self._spares is not None else None
        spare_ready = spare is not None and spare.state is SpareState.READY
        proc: subprocess.Popen | None = None
        if spare is not None:
            if spare.hand_over(env, output.child_fds()):
                proc = spare.proc
            else:
                self.events.emit("spare_handover_failed", rank=rank, pid=spare.proc.pid, reason=spare.failure)
        if proc is None:
            try:
                proc = subprocess.Popen(self.entry.argv(c.script_args), env=env, preexec_fn=die_with_parent,
                                        **output.popen_kwargs())
            except OSError as e:
                raise AgentError(f"cannot start {self.entry.target!r}: {e.strerror or e}") from None
        output.start(proc)
        self._exits.watch(proc.pid)
        self.workers[rank] = _Worker(rank=rank, proc=proc, generation=generation, output=output)
        self.events.emit("worker_spawned", rank=rank, pid=proc.pid, generation=generation,
                         replacement=replacement, warm=spare is not None and proc is spare.proc,
                         spare_ready=spare is not None and proc is spare.proc and spare_ready)

    def _spare_pool(self) -> SparePool | None:
        """The warm spares (resilient_train.spares): each starts with this node's worker environment."""
        c = self.config
        if not c.warm_spare or c.spares == 0 or self.entry.python_argv is None:
            return None

        def env_for(slot: int) -> dict[str, str]:
            local = slot % c.nproc_per_node  # spares differ per local rank only with --virtual-local-rank
            return spare_env(self._worker_env(c.node_rank * c.nproc_per_node + local, 0, False, None))

        return SparePool(self.entry, c.script_args, env_for=env_for, emit=self.events.emit, size=self._spares_wanted())

    def _spares_wanted(self) -> int:
        """``--spares`` (default 1: one lost rank); a spare node still waiting: one per local rank it may take over."""
        c = self.config
        if self._waiting:
            return max(c.nproc_per_node, c.spares or 0)
        return 1 if c.spares is None else c.spares

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        c = self.config
        self.events.emit("agent_start", world_size=c.world_size, port=self.port, script=self.entry.target,
                         entry=self.entry.kind.value, args=c.script_args)
        self._announce()
        if self._dashboard is not None:
            self._dashboard.start()
        uses_runtime = self.entry.mentions_runtime()
        if uses_runtime:
            # A Supervisor job: the spare imports torch first, alone. The ranks starting beside it would
            # slow its import several-fold, and a fault early in the run would find it still cold.
            if self._spares is not None and c.spare:
                self._spares.enable()  # a spare node has no ranks yet: it warms its spares while it waits
            elif self._spares is not None:
                self._spares.warm_first(wait_ready_s=30.0)
        previous = self._install_signal_handlers()
        try:
            if c.spare and not self._take_a_node():
                if self._shutdown.from_node is not None:  # the job was preempted: it is requeued, and so is this
                    self.events.emit("agent_end", ok=False, reason="preempted", exit_code=exitcodes.REQUEUE,
                                     restarts=0, spare_unused=True)
                    self._say(f"the job was preempted before it needed this spare node (exit code {exitcodes.REQUEUE})")
                    return exitcodes.REQUEUE
                self.events.emit("agent_end", ok=True, restarts=0, spare_unused=True)
                self._say("the job ended without needing this spare node")
                return 0
            self._start_node()
            if self._spares is not None:
                self._spares.resize(self._spares_wanted())  # a spare node's ranks took its spares: now a node's
            while True:
                if self._signal is not None:
                    raise AgentStopped(self._signal)
                stopping = self._shutdown.stopping(self.store)  # another node's agent was signalled
                if stopping is not None:
                    return self._shut_down(stopping, signalled=False)
                self._poll_workers()
                self._poll_monitor()
                self._poll_nodes()
                self._notice_supervised()
                if self._spares is not None:
                    self._spares.poll()
                if self._stop_code == exitcodes.REQUEUE:
                    return self._shut_down(None, signalled=False)  # preempted: the other ranks are saving
                if self._stop_code is not None:
                    reason = self._stop_reason or "the rerun policy stopped the job"
                    self._stop_workers(grace_s=5.0)
                    self.events.emit("agent_end", ok=False, reason=reason, exit_code=self._stop_code,
                                     restarts=self.restarts)
                    self._say(f"job stopped: {reason} (exit code {self._stop_code})")
                    self._leave_job()
                    return self._stop_code
                if all(w.state is WorkerState.SUCCEEDED for w in self.workers.values()):
                    self._leave_job()
                    self.events.emit("agent_end", ok=True, restarts=self.restarts)
                    return 0
                time.sleep(c.monitor_interval_s)
        except AgentStopped as e:
            return self._shut_down(e.signum, signalled=True)
        except dist.DistError as e:
            if self._hosting:
                raise
            # Node 0's agent hosts the store: its host is gone (or it stopped), and the job with it.
            error = AgentError(f"lost the store on {c.master_addr}:{c.master_port} (node 0's agent is gone): "
                               f"stopping; start the job again to resume from its newest checkpoint "
                               f"({str(e).splitlines()[0][:120]})")
            self.events.emit("agent_end", ok=False, reason=str(error), exit_code=error.exit_code,
                             restarts=self.restarts)
            raise error from None
        except AgentError as e:
            self.events.emit("agent_end", ok=False, reason=str(e), exit_code=e.exit_code, restarts=self.restarts)
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.close()

    def _start_node(self) -> None:
        """Registers this node's agent and starts its ranks: replacements when the job already ran without them."""
        c = self.config
        incarnation = 1
        if c.nnodes > 1:
            incarnation = register_node(self.store, c.node_rank)
            self._heartbeat = Heartbeat(self._connect_store, c.node_rank, incarnation)
        first = c.node_rank * c.nproc_per_node
        # A node that comes back (or a spare taking one): its ranks' predecessors registered with the Supervisor.
        returning = c.nnodes > 1 and (incarnation > 1 or c.spare) and self.store.check([Keys.supervised(first)])
        if c.nnodes > 1:
            self.events.emit("node_started", node=c.node_rank, incarnation=incarnation, returning=returning)
        generation = current_generation(self.store) if returning else 0
        for local in range(c.nproc_per_node):
            self._spawn(first + local, generation, replacement=returning)

    def _leave_job(self, timeout_s: float = 60.0, *, until: float | None = None) -> None:
        """A many-node job: this node is done; node 0's agent keeps the store up until every node is
        (``timeout_s`` at most, or ``until``, a monotonic time)."""
        c = self.config
        if c.nnodes == 1:
            return
        self.store.set(NodeKeys.done(c.node_rank), "1")
        if not self._hosting:
            return
        deadline = time.monotonic() + timeout_s if until is None else until
        timeout_s = max(0.0, deadline - time.monotonic())
        pending = [n for n in range(c.nnodes) if n != c.node_rank]
        while pending and time.monotonic() < deadline:
            pending = [n for n in pending if not self.store.check([NodeKeys.done(n)])]
            time.sleep(0.05)
        if pending:
            self._say(f"nodes {pending} did not finish within {timeout_s:g} s of this one; closing the store")

    def _take_a_node(self) -> bool:
        """A spare's wait: True once a lost node was handed to it (it is now that node), False when the job ended."""
        c = self.config
        index = register_spare(self.store)
        self.events.emit("spare_waiting", spare=index)
        self._say(f"spare node agent {index}: waiting for a node to replace")

        def done() -> bool:
            if self._spares is not None:
                self._spares.poll()  # warms one spare per local rank while it waits
            return (self._signal is not None or self.store.check([Keys.FINAL]) or read_stop(self.store) is not None
                    or self._shutdown.stopping(self.store) is not None)

        node = wait_for_assignment(self.store, index, done=done)
        if node is None:
            if self._signal is not None:
                raise AgentStopped(self._signal)
            return False
        c.node_rank = node
        self._shutdown = self._new_shutdown()
        self._waiting = False
        self._monitor_for(node)
        self._nodes = NodeWatch(self.store, node, c.nnodes, c.node_timeout_s)
        self._say(f"spare node agent {index}: taking over node {node}")
        return True

    def _poll_nodes(self) -> None:
        """Beats for this node; the first agent to see another node lost hands it to a spare."""
        c = self.config
        if c.nnodes == 1:
            return
        for node, incarnation in self._nodes.poll():
            if (node, incarnation) in self._handled_losses:
                continue
            self._handled_losses.add((node, incarnation))
            if not claim_loss(self.store, node, incarnation, by=c.node_rank):
                continue  # another agent handles it
            g = current_generation(self.store)
            declare_fault(self.store, g, {"rank": node * c.nproc_per_node, "kind": "node_lost", "node": node,
                                          "time": time.time()}, world_size=c.world_size)
            spare = assign_spare(self.store, node)
            self.events.emit("node_lost", node=node, incarnation=incarnation, generation=g, spare=spare,
                             timeout_s=c.node_timeout_s)
            if spare is not None:
                self._say(f"node {node} lost (no beat for {c.node_timeout_s:g} s): handed to spare node agent {spare}")
            else:
                self._say(f"node {node} lost (no beat for {c.node_timeout_s:g} s) and no spare node: its ranks' "
                          "peers wait for it to come back (their join timeout), then the job stops")

    @property
    def _omp_default(self) -> bool:
        """torchrun's rule: OMP_NUM_THREADS=1 for several workers, unless the user set it."""
        c = self.config
        return c.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in c.env

    def _say(self, line: str) -> None:
        self.console.write(f"resilient-train: {line}\n".encode())

    def _announce(self) -> None:
        """What a torchrun user should know before the job starts, once."""
        c = self.config
        if self._omp_default:
            self._say("OMP_NUM_THREADS is set to 1 for each worker, as torchrun does (set it to tune)")
        if c.monitor.hang.enabled and not self.entry.mentions_runtime():
            self._say(f"hang detection is off for {Path(self.entry.target).name}: its ranks report no progress "
                      "(call resilient_train.heartbeat() once a step to turn it on)")

    def _install_signal_handlers(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}

        def handler(signum: int, frame: object) -> None:
            self._signal = signum
            if signum == signal.SIGINT:
                self.console.interrupt()  # Ctrl-C reached the ranks too: no traceback per rank

        for name in self.config.signals:
            signum = getattr(signal, name)
            try:
                previous[signum] = signal.signal(signum, handler)
            except ValueError:  # not the main thread (an agent run inside a test's thread)
                break
        return previous

    def _shut_down(self, signum: int | None, *, signalled: bool) -> int:
        """A signal (this node's, or another node's) or a preemption its ranks began: they get the grace, the
        rest is SIGKILLed, the exit code says what the ranks did, and the job hears that this node left."""
        if not self.workers and signum is not None:  # a spare agent that took no node: the job goes on
            self._say(f"received {signal.Signals(signum).name}: this spare node agent leaves; the job goes on")
            self.events.emit("agent_end", ok=False, reason="signalled while spare", exit_code=128 + signum, restarts=0)
            return 128 + signum
        sd = self._shutdown
        sd.begin(self.store, signum, signalled=signalled)
        if signalled:
            self._say(sd.received_line())
        if signum is not None:
            for w in self.workers.values():
                if w.proc.poll() is None:
                    try:
                        w.proc.send_signal(signum)
                    except ProcessLookupError:
                        pass
        left = sd.wait(self.store, lambda: {w.rank: w.proc for w in self.workers.values()})
        if left:
            self.events.emit("shutdown_killed", ranks=left, grace_s=sd.grace_s, timeout_s=sd.timeout_s)
        self._kill_workers()
        verdict = sd.verdict(self.store, {w.rank: w.proc.returncode for w in self.workers.values()})
        if verdict.line is not None:
            self._say(verdict.line)
        self.events.emit("agent_end", ok=verdict.exit_code == 0, reason=verdict.reason, exit_code=verdict.exit_code,
                         restarts=self.restarts, step=verdict.step, checkpoint_committed=verdict.committed)
        if not sd.store_lost:
            try:
                self._leave_job(until=sd.leave_by)
            except dist.DistError:  # node 0's agent closed the store after its grace: nothing left to tell
                pass
        return verdict.exit_code

    def _notice_supervised(self) -> None:
        """Spares are for Supervisor jobs: the first rank that registers with one starts the spare."""
        if self._supervised_seen or self._spares is None:
            return
        if any(self.store.check([Keys.supervised(r)]) for r in self.workers):
            self._supervised_seen = True
            self._spares.enable()

    def _poll_workers(self) -> None:
        dead: list[tuple[_Worker, int]] = []
        for w in list(self.workers.values()):
            if w.state is not WorkerState.RUNNING or self.workers.get(w.rank) is not w:
                continue  # finished, or replaced while this loop ran (a restart of every worker)
            rc = w.proc.poll()
            if rc is None:
                continue
            if rc == 0:
                w.state = WorkerState.SUCCEEDED
                continue
            w.state = WorkerState.FAILED
            if rc == exitcodes.STOPPED or (rc != 0 and read_stop(self.store) is not None):
                # A rank stopped the job (a bug that reproduced, a misuse): nothing to replace.
                stop = read_stop(self.store) or {"summary": f"rank {w.rank} exited with code {rc}"}
                if self._stop_code is None:
                    self.events.emit("worker_stopped_job", rank=w.rank, exit_code=rc, reason=stop.get("summary"))
                    self._stop_reason = f"rank {stop.get('rank', w.rank)} stopped it: {stop.get('summary')}"
                self._stop_code = int(stop.get("exit_code", exitcodes.STOPPED))
                continue
            if rc == exitcodes.REQUEUE:
                # Preempted: every rank stopped at one boundary after its checkpoint (resilient_train.preempt).
                if self._stop_code is None:
                    self.events.emit("worker_preempted", rank=w.rank)
                    self._stop_reason = "preempted; start the job again to resume from its checkpoint"
                self._stop_code = exitcodes.REQUEUE
                continue
            if rc == EXIT_VALIDATION_FAILED:
                # The rerun policy stopped the job after saving the last good state: not a rank to replace.
                self.events.emit("worker_stopped_job", rank=w.rank, exit_code=rc)
                self._stop_code = rc
                continue
            dead.append((w, rc))
        # The first to exit is the cause; a survivor that aborted when its peer's connection closed follows it.
        dead.sort(key=lambda d: (self._exits.exited_at(d[0].proc.pid) or time.monotonic(), d[0].rank))
        for i, (w, rc) in enumerate(dead):
            if self.workers.get(w.rank) is w:  # not already restarted by an earlier death of this poll
                self._on_death(w, rc, followed=[d[0] for d in dead[i + 1:]])

    def _poll_monitor(self) -> None:
        """Kills hung ranks (and stragglers under the "replace" policy); they then recover like dead ones."""
        found = self.monitor.poll()
        for snap in self.monitor.hangs.last.values():
            if snap is not None and snap.step > self._attempt_step:
                self._attempt_step = snap.step
        self._take_offered_monitor_state()
        # Changed timeouts are saved at once: rank 0 puts the saved file in each checkpoint it writes.
        since_saved = time.monotonic() - self._monitor_saved_at
        if since_saved >= self.config.monitor_state_every_s or (since_saved >= 0.5 and self.monitor.timeouts_changed()):
            self._save_monitor_state()
        causes: dict[int, dict] = {r: {"kind": "straggler"} for r in found.replace}
        for h in found.hangs:
            if h.rank in found.kill:
                causes[h.rank] = {"kind": "hang", "phase": h.section, "step": h.step,
                                  "since_progress_s": round(h.since_progress_s, 3), "timeout_s": h.timeout_s}
        for rank, cause in causes.items():
            w = self.workers.get(rank)
            if w is not None and w.state is WorkerState.RUNNING and w.cause is None and w.proc.poll() is None:
                w.cause = cause
                self._say(f"killing rank {rank}: {_kill_reason(cause)}")
                if cause["kind"] == "hang" and self._stacks.request(rank, w.proc.pid):
                    w.kill_at = time.monotonic() + DUMP_WAIT_S  # its stacks first, for the report
                else:
                    w.proc.kill()  # SIGKILL ends a stopped process too
        self._kill_dumped()
    def _kill_dumped(self) -> None:
        """SIGKILLs hung ranks whose stack dump had its time, and logs the stacks."""
        now = time.monotonic()
        for w in self.workers.values():
            if w.kill_at is None or (now < w.kill_at and not self._stacks.written(w.rank)):
                continue
            w.kill_at = None
            if w.proc.poll() is None:
                w.proc.kill()
            self._log_stacks(w)

    def _log_stacks(self, w: _Worker) -> None:
        stacks = self._stacks.collect(w.rank)
        self.events.emit("hang_stacks", rank=w.rank, pid=w.proc.pid, stacks=stacks or "(no dump written)")

    def _failure(self, w: _Worker, rc: int) -> Failure:
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        if w.cause is not None:
            return Failure(rank=w.rank, how=how, kind=w.cause["kind"], summary=_kill_reason(w.cause))
        w.output.drain()  # its last lines, the traceback among them, may still be in the pipe
        summary = w.output.failure_summary()
        kind = "signal" if rc < 0 else ("exception" if summary else "exit")
        return Failure(rank=w.rank, how=how, kind=kind, summary=summary if rc > 0 else None,
                       at=self._exits.exited_at(w.proc.pid) or time.monotonic())

    def _on_death(self, w: _Worker, rc: int, *, followed: list[_Worker]) -> None:
        failure = self._failure(w, rc)
        if self.store.check([Keys.FINAL]):
            # The final state is committed: the run is over whatever happens now.
            self.events.emit("worker_exit_after_final", rank=w.rank, how=failure.how)
            w.state = WorkerState.SUCCEEDED
            return
        if w.kill_at is not None:  # it died while dumping its stacks: log what it wrote
            w.kill_at = None
            self._log_stacks(w)
        g = current_generation(self.store)
        cause = w.cause or {"kind": "exit"}
        self.events.emit("fault_detected", rank=w.rank, how=failure.how, pid=w.proc.pid, generation=g,
                         summary=failure.summary, **cause)
        if self.store.check([Keys.supervised(w.rank)]):
            self.replacements += 1
            if self.replacements > self.config.max_replacements:
                raise AgentError(f"rank {w.rank} died ({failure.how}) and the replacement budget "
                                 f"({self.config.max_replacements}, --max-replacements) is spent")
            declare_fault(self.store, g, {"rank": w.rank, "kind": cause["kind"], "how": failure.how,
                                          "time": time.time()}, world_size=self.config.world_size)
            self._spawn(w.rank, current_generation(self.store), replacement=True)
            return
        self._restart_all(failure, followed)

    def _restart_all(self, failure: Failure, followed: list[_Worker]) -> None:
        """torchrun's recovery, for scripts that do not use the supervisor."""
        if self.config.nnodes > 1:
            raise AgentError(f"{failure.describe()}; restarting every worker of a plain script across nodes is not "
                             "supported yet (the Supervisor's ranks are replaced in place on any node)")
        hung = [o.rank for o in followed if o.cause is not None and o.cause["kind"] == "hang"]
        if failure.kind == "hang" and hung:
            # Hung together: a rank waiting in a collective on a hung peer looks the same from outside.
            ranks = ", ".join(str(r) for r in sorted([failure.rank, *hung]))
            blame = f"ranks {ranks} hung ({failure.summary})"
        else:
            others = [f"rank {o.rank} ({self._failure(o, o.proc.returncode).how})" for o in followed
                      if o.proc.returncode not in (None, 0)]
            blame = failure.describe() + (f"; {', '.join(others)} followed" if others else "")
        decision = self.policy.decide(failure, reported_step=self._attempt_step)
        self.events.emit("attempt_failed", attempt=self._attempt, rank=failure.rank, how=failure.how,
                         kind=failure.kind, summary=failure.summary, followed=[o.rank for o in followed],
                         decision=decision.value)
        if decision is Decision.REPEATED:
            raise AgentError(f"{blame}, the same failure as attempt {self._attempt - 1} with no progress "
                             "in between: a bug, not a fault; not restarting", exit_code=exitcodes.STOPPED)
        if decision is Decision.BUDGET:
            budget = self.config.max_restarts
            raise AgentError(f"{blame}; " + ("no restarts allowed (--max-restarts 0)" if budget == 0 else
                                             f"the restart budget ({budget}, --max-restarts) is spent"))
        self._say(f"{blame}; restarting every worker (restart {self.policy.restarts} of {self.config.max_restarts})")
        self.events.emit("restart_all", reason=blame, attempt=self._attempt + 1)
        self._kill_workers()
        self._attempt += 1
        self._attempt_step = -1
        self._rehost_store()
        c = self.config
        for local in range(c.nproc_per_node):
            self._spawn(c.node_rank * c.nproc_per_node + local, 0, replacement=False)

    def _stop_workers(self, grace_s: float = 5.0) -> None:
        """The job is stopping: ranks that saw the stop key leave on their own; the rest are killed after a grace."""
        deadline = time.monotonic() + grace_s
        for w in self.workers.values():
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill_workers()

    def _kill_workers(self) -> None:
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.kill()
        for w in self.workers.values():
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _take_offered_monitor_state(self) -> None:
        """Merges the monitor state a rank found in the checkpoint it resumed from (monitors.persist)."""
        path = offered_state_path(self.run_dir)
        if not path.exists():
            return
        if self._offer_taken:
            # Once per job: the first resume brought the saved view; later disk fallbacks in this job
            # would only count the same observations again.
            path.unlink(missing_ok=True)
            return
        self._offer_taken = True
        try:
            offer = take_offer(self.run_dir)
            if offer is None:
                return
            step, state = offer
            self.monitor.load_state_dict(state)
            self.events.emit("monitor_state_loaded", path=str(path), source="checkpoint", step=step,
                             timeouts_s=self.monitor.state_dict()["hang"]["timeouts_s"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.events.emit("monitor_state_ignored", path=str(path), reason=f"{type(e).__name__}: {e}")
            self._say(f"the checkpoint's hang timeouts are ignored: {e}")

    def _save_monitor_state(self) -> None:
        self._monitor_saved_at = time.monotonic()
        try:
            self.monitor.save_state(self._monitor_state)
        except OSError as e:  # a full disk must not stop the job
            self.events.emit("monitor_state_not_saved", path=str(self._monitor_state), reason=str(e))

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
        if self._dashboard is not None:
            self._dashboard.close()
        self._kill_workers()
        for w in self.workers.values():
            w.output.drain(timeout_s=0.5)
        self._exits.close()
        self._save_monitor_state()
        self.monitor.close()
        if self._spares is not None:
            self._spares.close()


def _kill_reason(cause: dict) -> str:
    if cause["kind"] == "hang":
        where = f"in {cause['phase']}" + (f" at step {cause['step']}" if cause.get("step", -1) >= 0 else "")
        return (f"hung {where}: no progress for {cause['since_progress_s']:.1f} s "
                f"(timeout {cause['timeout_s']:.1f} s)")
    return "a straggler (straggler policy: replace)"


def job_token(config: AgentConfig) -> tuple[str, str]:
    """The job's secret namespace in the store and where it came from; the agents of a many-node job share it
    (resilient_train.jobtoken: never derived from --rdzv-id, which ``ps`` shows)."""
    if config.nnodes == 1:
        return new_token(), "drawn by the agent"
    try:
        return shared_token(token_file=config.job_token_file, environ_token=os.environ.get(E.RT_JOB_TOKEN),
                            run_dir=Path(config.run_dir))
    except ValueError as e:
        raise AgentError(str(e)) from None
