"""The node agent's configuration: one keyword-only dataclass, checked once, before anything starts.

``resilient_train.launch`` builds it from torchrun's flags and ours; a bad value
is a ``ValueError`` with a one-line message (exit 2 at the command line).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from monitors import MonitorConfig
from resilient_train.base.cliargs import check_host
from monitors.dashboard.server import DashboardConfig, DashboardUnavailable
from monitors.dashboard.server import check_available as check_dashboard
from resilient_train.agent.entry import Entry, EntryKind
from resilient_train.protocol.jobtoken import read_token_file
from resilient_train.protocol.shutdown import check_seconds
from resilient_train.agent.workerio import OutputConfig

__all__ = ["SIGNALS", "AgentConfig"]

SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")  # the ones an agent may forward


@dataclass(kw_only=True)
class AgentConfig:
    script: str = ""  # the training script (shorthand for entry: {kind: script, target: SCRIPT})
    entry: Entry | None = None  # what each worker runs: a script, a module (-m) or a program (--no-python)
    script_args: list[str] = field(default_factory=list)  # the script's own arguments
    nproc_per_node: int = 1  # workers on this node
    nnodes: int = 1  # nodes in the job (an elastic job: at most; its width is nnodes x nproc_per_node logical ranks)
    # An elastic job (--nnodes MIN:MAX): it runs on as few as this many nodes; None: nnodes (a fixed node count)
    min_nodes: int | None = None
    last_call_s: float = 5.0  # an elastic job starts this long after MIN nodes came, or once all came (last_call_timeout)
    join_timeout_s: float = 600.0  # an elastic job's node 0 waits this long for MIN nodes (--rdzv-conf join_timeout)
    node_rank: int = 0  # this node's rank
    master_addr: str = "127.0.0.1"  # the store's host: node 0
    master_port: int = 0  # the store's port; 0: pick a free port (kept for every attempt either way)
    fixed_port: bool = False  # the user gave the port
    run_id: str = "none"  # TORCHELASTIC_RUN_ID (--rdzv-id)
    role: str = "default"  # ROLE_NAME, and the console prefix (output.role follows it)
    run_dir: str = "runs/latest"  # events.jsonl, final/ and checkpoints go here
    max_restarts: int = 0  # restarts of every worker (torchrun's meaning and default)
    max_replacements: int = 10  # in-place replacements of dead Supervisor ranks
    warm_spare: bool = True  # only for scripts that use the Supervisor
    spares: int | None = None  # warm spares kept (None: 1; a spare node waiting: one per local rank)
    monitor_interval_s: float = 0.05  # between looks at the workers
    monitor_state_every_s: float = 5.0  # how often the computed hang timeouts are saved to the run directory
    chaos: str = ""  # JSON list of faults for the workers (chaos.dumps_faults)
    env: dict[str, str] = field(default_factory=dict)  # more environment variables for the workers
    output: OutputConfig = field(default_factory=OutputConfig)  # the workers' stdout and stderr
    signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")  # forwarded to the workers
    # After a forwarded signal, then SIGKILL (None: torchrun's 30 s); a Supervisor job follows its ranks'
    # preemption grace instead (resilient_train.protocol.shutdown).
    shutdown_timeout_s: float | None = None
    virtual_local_rank: bool = False  # LOCAL_RANK=0 for every worker, each seeing only its own GPU
    spare: bool = False  # a spare node's agent: it waits, then takes over a lost node (resilient_train.protocol.nodes)
    node_timeout_s: float = 10.0  # a node whose agent has not beaten for this long is lost
    job_token_file: str | None = None  # many nodes: the file holding the job's secret (resilient_train.protocol.jobtoken)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)  # hangs, stragglers, metrics
    dashboard: DashboardConfig | None = None  # serve the live dashboard (monitors.dashboard) while the job runs

    def __post_init__(self) -> None:
        """Every check names the field and its flag. Without a script or entry the config is incomplete (a run
        config file need not name one): :class:`~resilient_train.agent.Agent` refuses it."""
        if self.entry is None and self.script:
            self.entry = Entry(kind=EntryKind.SCRIPT, target=self.script)
        if self.entry is not None:
            if self.script and self.script != self.entry.target:
                raise ValueError(f"agent.script {self.script!r} and agent.entry.target {self.entry.target!r} "
                                 "differ: give one (the script is the entry's shorthand)")
            self.script = self.entry.target
        if self.output.role == "default" and self.role != "default":
            self.output = replace(self.output, role=self.role)
        if self.nproc_per_node < 1:
            raise ValueError(f"agent.nproc_per_node (--nproc-per-node) must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"agent.nnodes (--nnodes) must be at least 1, got {self.nnodes}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise ValueError(f"agent.min_nodes (--nnodes MIN:MAX) must be in [1, {self.nnodes}], got {self.min_nodes}")
        if self.min_nodes is None:
            self.min_nodes = self.nnodes
        check_seconds(self.last_call_s, "agent.last_call_s (--rdzv-conf last_call_timeout)", zero_ok=True)
        check_seconds(self.join_timeout_s, "agent.join_timeout_s (--rdzv-conf join_timeout)")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("--nnodes > 1 needs the store's port: --master-port P (or --rdzv-endpoint HOST:PORT; "
                             "agent.master_port)")
        if self.spare and self.nnodes == 1:
            raise ValueError("--spare (agent.spare) is for a many-node job (--nnodes > 1)")
        check_seconds(self.node_timeout_s, "agent.node_timeout_s (--node-timeout)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"agent.node_rank (--node-rank) must be in [0, {self.nnodes}), got {self.node_rank}")
        check_host(self.master_addr, "agent.master_addr (--master-addr)")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"agent.master_port (--master-port) must be in [0, 65535], got {self.master_port}")
        if self.max_restarts < 0:
            raise ValueError(f"agent.max_restarts (--max-restarts) must be >= 0, got {self.max_restarts}")
        if self.spares is not None and not 0 <= self.spares <= 64:
            raise ValueError(f"agent.spares (--spares) must be in [0, 64], got {self.spares}")
        if self.max_replacements < 0:
            raise ValueError(f"agent.max_replacements (--max-replacements) must be >= 0, got {self.max_replacements}")
        if not 0 < self.monitor_interval_s <= 60:
            raise ValueError(f"agent.monitor_interval_s (--monitor-interval) must be in (0, 60], "
                             f"got {self.monitor_interval_s}")
        check_seconds(self.monitor_state_every_s, "agent.monitor_state_every_s")
        if self.shutdown_timeout_s is not None:
            check_seconds(self.shutdown_timeout_s, "--shutdown-timeout", zero_ok=True)
        bad = [s for s in self.signals if s not in SIGNALS]
        if bad:
            raise ValueError(f"agent.signals (--signals-to-handle): unknown signal {bad[0]} (one of {', '.join(SIGNALS)})")
        for name in ("redirects", "tee"):
            ranks = sorted(r for r in getattr(self.output, name) if not 0 <= r < self.nproc_per_node)
            if ranks:
                raise ValueError(f"agent.output.{name}: local rank {ranks[0]} is not in [0, {self.nproc_per_node})")
        if self.job_token_file is not None:
            read_token_file(self.job_token_file, "agent.job_token_file (--job-token-file)")
        if self.entry is not None and self.entry.kind is EntryKind.SCRIPT and not Path(self.entry.target).is_file():
            raise ValueError(f"script {self.entry.target!r} does not exist")
        if self.dashboard is not None:
            try:
                check_dashboard()  # a missing extra is bad input, said before anything starts
            except DashboardUnavailable as e:
                raise ValueError(str(e)) from None

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX`` with MIN < MAX: the nodes may come and go (resilient_train.agent.width)."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def first_rank(self) -> int:
        """This node's first global rank (its ranks are ``first_rank .. first_rank + nproc_per_node - 1``)."""
        return self.node_rank * self.nproc_per_node

    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc_per_node)

    @property
    def source(self) -> str:
        """The agent's name in events.jsonl."""
        return "agent" if self.nnodes == 1 else ("agent-spare" if self.spare else f"agent{self.node_rank}")
