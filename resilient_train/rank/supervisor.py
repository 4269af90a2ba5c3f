"""The supervisor: runs a training loop inside a rank and keeps it alive.

A user hands it a step function and a :class:`TrainState`. The supervisor is one loop over its lifecycle
(:mod:`resilient_train.rank.lifecycle`): join a generation, restore, train, finish; on a fault, recover and join the
next. Each generation builds its process group on its own keys. A step commits only when every rank voted for it in
the gradient reduction (:mod:`resilient_train.rank.commit`), so after a fault every survivor is at a step boundary; ranks
that lost the state (replacements, a rank torn in its optimizer update, a rank one step behind) heal from a live
replica. Optional parts (progress, chaos, disk checkpoints, host snapshots, CUPTI, rerun) plug in through
:mod:`resilient_train.rank.parts`. The supervisor holds what a script gives it before ``run``; each ``run`` builds
its own :class:`~resilient_train.rank.running.Run`, which holds what the run builds and learns. See docs/design.md.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from monitors import EventLog
from monitors.stacks import install_stack_dump
from resilient_train.protocol import env as envvars
from resilient_train.protocol.store import connect_worker_store
from resilient_train.rank.assemble import make_reproducible
from resilient_train.rank.buddy import BuddyCopies
from resilient_train.rank.config import SupervisorConfig, say_unused_run_config
from resilient_train.rank.context import StepContext, StepFn
from resilient_train.rank.ddp import ReplicatedModule, explain_ddp_before_run
from resilient_train.rank.elastic.rank import RankWidth
from resilient_train.rank.errors import GenerationFailed, UsageError
from resilient_train.rank.generation import RunFinished
from resilient_train.rank.group import backend_device
from resilient_train.rank.local_state import LocalSlots
from resilient_train.rank.mesh import MeshSpec
from resilient_train.rank.parts import Part, SnapshotPart
from resilient_train.rank.reducer import GradientReducer
from resilient_train.rank.running import Run
from resilient_train.rank.sharded import Parallelize, ShardedModule, check_sharded_run
from resilient_train.rank.train_state import TrainState

__all__ = ["GenerationFailed", "RunFinished", "StepContext", "Supervisor", "SupervisorConfig"]


class Supervisor:
    def __init__(self, config: SupervisorConfig | None = None, *, env: envvars.WorkerEnv | None = None) -> None:
        self.config = config = SupervisorConfig.from_run_config() if config is None else config  # None: the run's
        if config.steps is None:
            raise UsageError("SupervisorConfig.steps is not set: pass steps=N, or set supervisor.steps in the run config")
        say_unused_run_config(config)
        self.env = env or envvars.WorkerEnv.from_environ()
        if config.reproducible:
            # cuBLAS is deterministic only with a fixed workspace, set before its first use.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.backend, self.device = backend_device(config.backend, self.env.local_rank)
        self.run_dir = Path(self.env.run_dir) if self.env.run_dir else None
        self.events = EventLog(self.run_dir / "events.jsonl" if self.run_dir else None, source=f"rank{self.env.rank}",
                               warn=not self.env.under_agent)
        self.current: Run | None = None  # the run under way (resilient_train.rank.running), once run() began
        self._ddps: list[tuple[ReplicatedModule, GradientReducer | None]] = []
        self._added: list[Part] = []  # add_part(): before the built-in parts, so they see a generation first
        self._sharded: ShardedModule | None = None
        self._mesh_spec: MeshSpec | None = None
        # On SIGUSR2 every thread's stack goes to RUN_DIR/.monitors/rank{r}.stacks: the agent's, before a kill.
        self._stacks_file = install_stack_dump(self.run_dir, self.env.rank) if self.run_dir else None
        self.store = connect_worker_store(self.env, timeout=timedelta(seconds=config.join_timeout_s))
        self._join_store = self.store.clone()  # a join blocks its connection: a preempted main thread needs another
        self.slots = LocalSlots(self.store)
        self.width = RankWidth(self.env, config, self.events)  # who computes which logical rank (elastic/)
        explain_ddp_before_run(self.store, self.env.rank)

    # --------------------------------------------------------------- public
    def ddp(self, model: torch.nn.Module, **ddp_kwargs: Any) -> ReplicatedModule:
        """``model`` data-parallel: call what this returns as you would a DDP model.

        DDP is built again on every generation's group, its buckets the supervisor's fixed plan (bitwise
        across recoveries, overlapping backward, nothing copied). ``ddp_kwargs`` go to DDP.
        """
        wrapped = ReplicatedModule(model, ddp_kwargs, phase=self._auto_phase)
        self._ddps.append((wrapped, None))
        return wrapped

    def seed(self, seed: int) -> None:
        """Seeds torch's, Python's and NumPy's RNGs for this rank, and for every logical rank this process
        computes in an elastic job, each from ``seed`` and its number (resilient_train.rank.elastic.rank)."""
        self.width.seed(seed)

    def add_part(self, part: Part) -> None:
        """Plugs ``part`` (an integration, such as Megatron's parallel state) into the loop; call before ``run``."""
        if not isinstance(part, Part):
            raise UsageError(f"add_part takes a resilient_train.rank.parts.Part, got {type(part).__name__}")
        if self.current is not None:
            raise UsageError("add_part must be called before run()")
        self._added.append(part)

    def sharded(self, model: torch.nn.Module, parallelize: Parallelize, *, mesh: MeshSpec | None = None) -> ShardedModule:
        """``model`` parallelised by ``parallelize(module, mesh)`` (``fully_shard``, ``parallelize_module``).

        Pass the model before it is parallelised, with its initial values: every generation the supervisor
        builds the mesh ``mesh`` describes on the new process group, applies ``parallelize`` to a fresh copy
        and moves this rank's shards into it (:mod:`resilient_train.rank.sharded`). Call what this returns, and
        give it to ``TrainState(model=...)``.
        """
        if self._sharded is not None:
            raise UsageError("sup.sharded was called twice: one sharded model per job (parallelize all of it at once)")
        if self._ddps:
            raise UsageError("sup.sharded and sup.ddp in one job: parallelize the whole model in one function")
        self._mesh_spec = mesh or MeshSpec()
        self._mesh_spec.sizes(self.env.world_size)  # a mesh the world does not fill is refused now
        self._sharded = ShardedModule(model, parallelize, phase=self._auto_phase)
        return self._sharded

    def run(self, step_fn: StepFn, state: TrainState, *, on_new_group: Callable[[], None] | None = None) -> TrainState:
        """Runs ``step_fn`` until ``state.step == config.steps``, through faults."""
        if dist.is_initialized():
            raise UsageError("the supervisor builds the process group itself: do not call init_process_group")
        if self.config.reproducible:
            make_reproducible()
        if self._sharded is not None:
            check_sharded_run(self._sharded, state.model, snapshot_every=self.config.snapshot_every,
                              rerun=self.config.rerun.enabled)
        self.width.check(self.config, sharded=self._sharded is not None)
        self.current = Run(self, step_fn, state, on_new_group)
        return self.current.loop()

    # ------------------------------------------------- the run, from inside
    @property
    def generation(self) -> int:
        """The generation this rank trains in (-1: none yet, or between two)."""
        return self.current.generation if self.current is not None else -1

    @property
    def mesh(self) -> Any:
        """The current generation's DeviceMesh (``sup.sharded``, ``mesh=``); None outside a generation."""
        return self.current.mesh if self.current is not None else None

    @property
    def buddy(self) -> BuddyCopies | None:
        return self.current.buddy if self.current is not None else None

    @property
    def snapshot(self) -> SnapshotPart | None:
        return self.current.snapshot if self.current is not None else None

    def _auto_phase(self, name: str) -> None:
        assert self.current is not None, "a model wrapped by the supervisor runs inside sup.run"
        self.current.stepper.auto_phase(name)
