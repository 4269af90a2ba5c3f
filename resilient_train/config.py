"""The supervisor's configuration: one keyword-only dataclass (the agent's is ``AgentConfig``).

Under ``resilient-train run`` a field the script leaves out takes its value from
the run config the agent wrote (``RT_RUN_CONFIG``: ``--config FILE`` and the
``--supervisor.*`` flags); ``checkpoint``, ``rerun`` and ``preemption`` come
from that file's sections of those names. What the script passes wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from checkpointing import CheckpointConfig
from monitors.configfile import MAX_COUNT, MAX_SECONDS, require_int, require_number
from monitors.runfile import file_defaults
from monitors.cupti_kernels import CuptiConfig
from resilient_train import env as envvars
from resilient_train.preempt import PreemptionConfig
from resilient_train.buckets import DEFAULT_BUCKET_MB
from resilient_train.rerun import RerunConfig

__all__ = ["SupervisorConfig"]


@file_defaults("supervisor", links={"checkpoint": "checkpoint", "rerun": "rerun", "preemption": "preemption"},
               say_overrides=True)
@dataclass(kw_only=True)
class SupervisorConfig:
    steps: int | None = None  # steps to train; None: the run config's supervisor.steps (the Supervisor needs one)
    backend: str = "auto"  # "gloo", "nccl", or "auto" (nccl when CUDA is available)
    pg_timeout_s: float = 30.0  # gloo cannot be aborted: this bounds a collective stuck on a silent peer
    join_timeout_s: float = 120.0  # to join a generation's process group and store
    max_recoveries: int = 32  # in the whole run
    max_failed_generations: int = 8  # in a row without a completed step: then the job stops
    # Deterministic algorithms and one intra-op thread: bitwise verdicts (the chaos runner, the demo, the tests).
    reproducible: bool = field(default_factory=lambda: os.environ.get(envvars.RT_REPRODUCIBLE) == "1",
                               metadata={"default": "false (RT_REPRODUCIBLE=1: true)"})
    snapshot_every: int | None = None  # a host snapshot every k steps (off: live replicas are the redundancy)
    # sup.sharded: a shard no other rank holds (pure FSDP or TP) is copied to a buddy every k steps;
    # None: k chosen from the job's first steps, so that the copies cost at most 2% (resilient_train.buddy)
    buddy_every: int | None = None
    chunk_mb: float = DEFAULT_BUCKET_MB  # the gradient reduction's bucket size (DDP's bucket_cap_mb; fixed for the run)
    # The gradients averaged in logical-rank order (all-to-all, ordered sum, all-gather: the same bits on any
    # number of processes, resilient_train.elastic); None: for elastic jobs (--nnodes MIN:MAX) only
    ordered_reduction: bool | None = None
    # The collectives of world > 1 at a world of one too (the reduction, the vote): to measure that path on one GPU
    force_reduction: bool = field(default_factory=lambda: os.environ.get(envvars.RT_FORCE_REDUCTION) == "1",
                                  metadata={"default": "false (RT_FORCE_REDUCTION=1: true)"})
    write_final: bool = True  # RUN_DIR/final/: the last state, gathered, for ckpt diff and the verdicts
    checkpoint: CheckpointConfig | None = None  # disk checkpoints (see resilient_train.disk)
    watch_interval_s: float = 0.05  # the generation watcher's interval (resilient_train.watch)
    rerun: RerunConfig = field(default_factory=RerunConfig)  # result validation and re-runs (resilient_train.rerun)
    # NVRx's CUPTI kernel scores, reported as events (needs the nvrx extra and CUDA; monitors.cupti_kernels)
    cupti: CuptiConfig | None = None
    # SIGTERM/SIGUSR1: every rank stops at one boundary, after a committed checkpoint (resilient_train.preempt)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)

    def __post_init__(self) -> None:
        if self.steps is not None:
            require_int(self.steps, "supervisor.steps", low=0, high=MAX_COUNT)
        for name in ("pg_timeout_s", "join_timeout_s", "watch_interval_s"):
            require_number(getattr(self, name), f"supervisor.{name}", above=0, high=MAX_SECONDS)
        require_int(self.max_recoveries, "supervisor.max_recoveries", low=0, high=MAX_COUNT)
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1 or None, got {self.snapshot_every}")
        if self.buddy_every is not None and self.buddy_every < 1:
            raise ValueError(f"buddy_every must be >= 1 or None, got {self.buddy_every}")
        if self.max_failed_generations < 1:
            raise ValueError(f"max_failed_generations must be >= 1, got {self.max_failed_generations}")
        if not self.chunk_mb > 0:
            raise ValueError(f"chunk_mb must be > 0, got {self.chunk_mb}")
