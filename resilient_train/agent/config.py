"""The node agent's configuration: one keyword-only dataclass, checked once, before anything starts.

``resilient_train.launch`` builds it from torchrun's flags and ours; a bad value
is a ``ValueError`` with a one-line message (exit 2 at the command line).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from monitors import MonitorConfig
from monitors.dashboard.server import DashboardConfig, DashboardUnavailable
from monitors.dashboard.server import check_available as check_dashboard
from resilient_train.entry import Entry, EntryKind
from resilient_train.shutdown import check_seconds
from resilient_train.workerio import OutputConfig

__all__ = ["AgentConfig"]


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
