"""The supervisor's configuration: one keyword-only dataclass (the agent's is ``AgentConfig``).

A ``SupervisorConfig`` is what its constructor was given, nothing else. The
run config of ``resilient-train run`` (``--config FILE``, ``--SECTION.FIELD=VALUE``,
written to ``RUN_DIR/run-config.yaml`` and named to the ranks in ``RT_RUN_CONFIG``)
reaches a rank in one place: :meth:`SupervisorConfig.from_run_config`, which
``rt.Supervisor()`` calls when it is given no config. Its ``checkpoint``,
``rerun`` and ``preemption`` come from the run config's sections of those names
(:data:`ROOT_SECTIONS`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from checkpointing import CheckpointConfig
from resilient_train.base.configfile import MAX_COUNT, MAX_SECONDS, require_int, require_number
from resilient_train.base.configtree import RT_RUN_CONFIG, build, field_default
from monitors.cupti_kernels import CuptiConfig
from resilient_train.base.runfile import read_run_file
from resilient_train.rank.preempt import PreemptionConfig
from resilient_train.rank.buckets import DEFAULT_BUCKET_MB
from resilient_train.rank.rerun import RerunConfig

__all__ = ["ROOT_SECTIONS", "SupervisorConfig", "say_unused_run_config", "unused_run_config"]

# The supervisor's fields that are sections of the run config's root: field -> section (resilient_train.runconfig).
ROOT_SECTIONS: dict[str, str] = {"checkpoint": "checkpoint", "rerun": "rerun", "preemption": "preemption"}


@dataclass(kw_only=True)
class SupervisorConfig:
    steps: int | None = None  # steps to train; None: the run config's supervisor.steps (the Supervisor needs one)
    backend: str = "auto"  # "gloo", "nccl", or "auto" (nccl when CUDA is available)
    pg_timeout_s: float = 30.0  # gloo cannot be aborted: this bounds a collective stuck on a silent peer
    join_timeout_s: float = 120.0  # to join a generation's process group and store
    max_recoveries: int = 32  # in the whole run
    max_failed_generations: int = 8  # in a row without a completed step: then the job stops
    # Deterministic algorithms and one intra-op thread: bitwise verdicts (the chaos runner, the demo, the tests;
    # the agent sets it in the run config when RT_REPRODUCIBLE=1)
    reproducible: bool = False
    snapshot_every: int | None = None  # a host snapshot every k steps (off: live replicas are the redundancy)
    # sup.sharded: a shard no other rank holds (pure FSDP or TP) is copied to a buddy every k steps;
    # None: k chosen from the job's first steps, so that the copies cost at most 2% (resilient_train.rank.buddy)
    buddy_every: int | None = None
    chunk_mb: float = DEFAULT_BUCKET_MB  # the gradient reduction's bucket size (DDP's bucket_cap_mb; fixed for the run)
    # The gradients averaged in logical-rank order (all-to-all, ordered sum, all-gather: the same bits on any
    # number of processes, resilient_train.rank.elastic); None: for elastic jobs (--nnodes MIN:MAX) only
    ordered_reduction: bool | None = None
    # The collectives of world > 1 at a world of one too (the reduction, the vote): to measure that path on one GPU
    # (the agent sets it in the run config when RT_FORCE_REDUCTION=1)
    force_reduction: bool = False
    write_final: bool = True  # RUN_DIR/final/: the last state, gathered, for ckpt diff and the verdicts
    checkpoint: CheckpointConfig | None = None  # disk checkpoints (see resilient_train.rank.disk)
    watch_interval_s: float = 0.05  # the generation watcher's interval (resilient_train.rank.watch)
    rerun: RerunConfig = field(default_factory=RerunConfig)  # result validation and re-runs (resilient_train.rank.rerun)
    # NVRx's CUPTI kernel scores, reported as events (needs the nvrx extra and CUDA; monitors.cupti_kernels)
    cupti: CuptiConfig | None = None
    # SIGTERM/SIGUSR1: every rank stops at one boundary, after a committed checkpoint (resilient_train.rank.preempt)
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

    @classmethod
    def from_run_config(cls, path: str | os.PathLike[str] | None = None, /, **given: Any) -> "SupervisorConfig":
        """The run's config with ``given`` over it: the run config at ``path``, else the one ``RT_RUN_CONFIG``
        names (the agent sets it for its ranks), its ``supervisor`` section and its ``checkpoint``, ``rerun``
        and ``preemption`` sections; without either, the fields' defaults. A field in ``given`` wins whole
        (``checkpoint=CheckpointConfig(...)`` takes nothing from the file's section)."""
        data = read_run_file(path) or {}
        section = data.get("supervisor") or {}
        if not isinstance(section, dict):
            raise ValueError(f"run config: supervisor must be a mapping, got {type(section).__name__}")
        plain = {**section, **{name: data[root] for name, root in ROOT_SECTIONS.items() if root in data}}
        built = build(cls, plain, "supervisor")
        return dataclasses.replace(built, **given) if given else built


def unused_run_config(config: SupervisorConfig, run: SupervisorConfig) -> list[str]:
    """What the run's config ``run`` sets (to something else than the field's default) that ``config`` does
    not hold, one text each: a ``--checkpoint.interval=25`` that a script's own config leaves out is said,
    never dropped in silence."""
    out = []
    for f in dataclasses.fields(SupervisorConfig):
        theirs, ours = getattr(run, f.name), getattr(config, f.name)
        if theirs == ours or theirs == field_default(f):
            continue
        key = ROOT_SECTIONS.get(f.name, f"supervisor.{f.name}")
        shown = key if dataclasses.is_dataclass(theirs) else f"{key}={theirs!r}"
        out.append(f"the run config's {shown} is not used: the script's SupervisorConfig has "
                   f"{f.name}={_brief(ours)}")
    return out


def _brief(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return f"{type(value).__name__}(...)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def say_unused_run_config(config: SupervisorConfig) -> None:
    """In a rank given a run config (``RT_RUN_CONFIG``), says on stderr what of it ``config`` does not use
    (rank 0 only: once a job, not once a rank)."""
    if not os.environ.get(RT_RUN_CONFIG) or os.environ.get("RANK", "0") != "0":
        return
    for line in unused_run_config(config, SupervisorConfig.from_run_config()):
        print(f"resilient-train: {line}, which wins (SupervisorConfig.from_run_config(...) takes the run "
              "config's for every field not passed to it)", file=sys.stderr, flush=True)
