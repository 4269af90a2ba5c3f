"""The supervisor: runs a training loop inside a rank and keeps it alive.

A user hands it a step function and a :class:`TrainState`. The supervisor is one loop over its lifecycle
(:mod:`resilient_train.rank.lifecycle`): join a generation, restore, train, finish; on a fault, recover and join the
next. Each generation builds its process group on its own keys. A step commits only when every rank voted for it in
the gradient reduction (:mod:`resilient_train.rank.commit`), so after a fault every survivor is at a step boundary; ranks
that lost the state (replacements, a rank torn in its optimizer update, a rank one step behind) heal from a live
replica. Optional parts (progress, chaos, disk checkpoints, host snapshots, CUPTI, rerun) plug in through
:mod:`resilient_train.rank.parts`. See docs/design.md.
"""

from __future__ import annotations

import os
from functools import partial
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from chaos import Phase
from monitors import EventLog
from monitors.stacks import install_stack_dump
from resilient_train.protocol import env as envvars
from resilient_train.rank.assemble import build_parts, make_reproducible, preemption_disk
from resilient_train.rank.buddy import BuddyCopies
from resilient_train.rank.config import SupervisorConfig, say_unused_run_config
from resilient_train.rank.context import StepContext, StepFn
from resilient_train.rank.ddp import ReplicatedModule, adopt_user_ddp, explain_ddp_before_run
from resilient_train.rank.disk import DEFAULT_TIMEOUT_S, DiskCheckpoints
from resilient_train.rank.errors import GenerationFailed, JobStopped, UsageError
from resilient_train.rank.storefollow import judge_following
from resilient_train.rank.finish import close_failed, end_run, finish_job
from resilient_train.rank.generation import RankMembership, ResumeSource, RunFinished
from resilient_train.rank.group import RELEASE_AT_EXIT_S, abort_nccl, backend_device, build_group, join_releases
from resilient_train.rank.group import release_group, release_retired
from resilient_train.rank.heal import restore_from_disk, restore_live
from resilient_train.rank.judge import Judge, Stop
from resilient_train.rank.lifecycle import Lifecycle, SupervisorState
from resilient_train.rank.local_state import LocalSlots
from resilient_train.rank.preempt import Preemption, checkpoint_for_preemption
from resilient_train.rank.mesh import MeshSpec, build_mesh, release_mesh
from resilient_train.rank.parts import DiskPart, Part
from resilient_train.rank.recovery import Recovery, stop_on_storage_fault
from resilient_train.rank.reducer import GradientReducer
from resilient_train.rank.elastic.rank import RankWidth
from resilient_train.rank.rendezvous import enter_generation, join_interruptibly
from resilient_train.rank.sharded import Parallelize, ShardedModule, check_sharded_run
from resilient_train.protocol.store import Keys, connect_worker_store
from resilient_train.rank.train_state import TrainState
from resilient_train.rank.watch import GenerationWatcher

__all__ = ["GenerationFailed", "RunFinished", "StepContext", "Supervisor", "SupervisorConfig"]

_S = SupervisorState


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
        self.lifecycle = Lifecycle()
        self.generation = -1
        self._progress_generation = -1  # the generation the rank is in, or heading to once it left one
        self.group: dist.ProcessGroup | None = None
        self._retired: list[list[dist.ProcessGroup]] = []  # failed groups still held by the script (_release_group)
        self._ddps: list[tuple[ReplicatedModule, GradientReducer | None]] = []
        self._added: list[Part] = []  # add_part(): before the built-in parts, so they see a generation first
        self._sharded: ShardedModule | None = None
        self._mesh_spec: MeshSpec | None = None
        self.mesh: Any = None  # the current generation's DeviceMesh (sup.sharded)
        self.buddy: BuddyCopies | None = None
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
        wrapped = ReplicatedModule(model, ddp_kwargs, phase=lambda name: self.stepper.auto_phase(name))
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
        if hasattr(self, "parts"):
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
        self._sharded = ShardedModule(model, parallelize, phase=lambda name: self.stepper.auto_phase(name))
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
        self.state = state
        self._on_new_group = on_new_group
        self.preemption = Preemption(self.config.preemption)  # SIGTERM/SIGUSR1 from here on: a stop at a boundary
        self._preempted: tuple[int, bool] | None = None  # (step, checkpoint committed) once stopped for one
        with stop_on_storage_fault(self.store, self.events, self.env, self.run_dir):  # a slot on a full disk
            self._setup_parts(state)
        self.store.set(Keys.supervised(self.env.rank), str(os.getpid()))
        self._publish_grace()  # the agent's SIGKILL follows it (resilient_train.protocol.shutdown)
        self.events.emit("run_start", rank=self.env.rank, pid=os.getpid(), world_size=self.env.world_size,
                         replacement=self.env.replacement, steps=self.config.steps, since_spawn_s=envvars.since_spawn())
        self._watcher = GenerationWatcher(self.store, rank=self.env.rank, interval_s=self.config.watch_interval_s,
                                          on_moved=self._on_moved)
        self._fresh = not self.env.replacement
        self._new_process = True
        self.judge = Judge(max_recoveries=self.config.max_recoveries,
                           max_failed_generations=self.config.max_failed_generations)
        self.recovery = Recovery(store=self.store, events=self.events, judge=self.judge, watcher=self._watcher,
                                 rank=self.env.rank, world_size=self.env.world_size,
                                 pg_timeout_s=self.config.pg_timeout_s, under_agent=self.env.under_agent)
        self._stopped: JobStopped | None = None
        self._store_lost: str | None = None  # the store is gone (node 0's agent): nothing to recover with
        handlers: dict[SupervisorState, Callable[[], SupervisorState]] = {
            _S.JOINING: self._join, _S.RESTORING: self._restore, _S.TRAINING: lambda: self._train(step_fn),
            _S.FINISHING: self._finish, _S.RECOVERING: self._recover, _S.PREEMPTING: self._preempt,
        }
        self.lifecycle.to(_S.JOINING)
        try:
            while self.lifecycle.state not in (_S.DONE, _S.FAILED):
                try:
                    nxt = handlers[self.lifecycle.state]()
                except RunFinished:
                    self.recovery.say_woken_detection(None)
                    nxt = _S.DONE
                except Exception as exc:  # noqa: BLE001  (every failure goes through the same judgement)
                    # The judgement needs the store: when it is lost, it is made again on the next host, if any.
                    nxt, self._store_lost, moved = judge_following(partial(self._judge, exc), self.store, self.env.rank)
                    self.generation = -1 if moved else self.generation  # a generation gone with the store
                self.lifecycle.to(nxt)
        finally:
            self.preemption.close()
            self._watcher.close()
            self.stepper.close()
            self._release_group()
            release_retired(self._retired)
            if self.disk is not None and self.parts.of(DiskPart) is None:
                self.disk.close()  # the preemption-only checkpoints
            join_releases(RELEASE_AT_EXIT_S)
            # Without the store every part fails to close: one line says why.
            close_failed(self.parts.close(), self.events, rank=self.env.rank, say=self._store_lost is None)
        code = end_run(self.events, rank=self.env.rank, step=state.step, recoveries=self.judge.recoveries,
                       under_agent=self.env.under_agent, store_lost=self._store_lost, stopped=self._stopped,
                       preempted=self._preempted is not None)
        if code is not None:
            raise SystemExit(code)
        return state

    # ---------------------------------------------------------------- parts
    def _setup_parts(self, state: TrainState) -> None:
        c, rank = self.config, self.env.rank
        built = build_parts(c, state, added=self._added, rank=rank, world_size=self.env.world_size, store=self.store,
                            run_dir=self.run_dir, events=self.events, device=self.device,
                            comm_device=self._comm_device, mesh_spec=self._mesh_spec,
                            sharded=self._sharded is not None, slots=self.slots, generation=lambda: self.generation,
                            progress_generation=lambda: self._progress_generation, group=lambda: self.group,
                            stop=self.preemption.flag, moved=lambda: self._watcher.moved.is_set(),
                            training=lambda: self.lifecycle.state is _S.TRAINING, elastic=self.env.elastic)
        self.disk, self.snapshot, self.rerun, self.buddy = built.disk, built.snapshot, built.rerun, built.buddy
        self.parts, self.stepper, self.ctx = built.parts, built.stepper, built.stepper.ctx
        self.stepper.initial = self.width.initial
        if self.env.replacement:
            self.stepper.live = None  # a replacement holds nothing until it is healed

    # ------------------------------------------------------------ lifecycle
    def _join(self) -> SupervisorState:
        self.stepper.enter("startup" if self._fresh else "recovery", self.state.step)
        t0 = time.monotonic()

        def me() -> RankMembership:
            snap = self.snapshot.snapshot.step if self.snapshot is not None else None
            spec = self._mesh_spec
            return RankMembership(rank=self.env.rank, pid=os.getpid(), live_step=self.stepper.live, snapshot_step=snap,
                              local_steps=self.slots.steps(self.env.rank), replacement=self.env.replacement,
                              fresh=self._fresh, new_process=self._new_process,
                              replica_class=spec.replica_class(self.env.rank, self.env.world_size) if spec else 0,
                              own_steps=self.buddy.own_steps() if self.buddy is not None else [],
                              buddy_steps=self.buddy.offered() if self.buddy is not None else {},
                              **self.width.report(self.slots))

        moved_to, self.recovery.moved_to = self.recovery.moved_to, None
        plan = join_interruptibly(
            lambda: enter_generation(self._join_store, world_size=self.env.world_size, me=me, moved_to=moved_to,
                                     timeout=self.config.join_timeout_s, stopped=self.recovery.raise_if_stopped,
                                     elastic=self.env.elastic),
            requested=lambda: self.preemption.overdue_in_join(since=t0), interrupt=lambda: self.recovery.stop_for_preemption(
                self.preemption.signal, fresh=self._fresh, step=self.ctx.step, generation=self.generation))
        self.recovery.say_woken_detection(plan)
        self.generation = self._progress_generation = plan.generation
        self._watcher.watch(plan.generation)
        self.stepper.enter(Phase.RENDEZVOUS.value, plan.step if plan.step is not None else self.state.step)
        width = self.width.adopt(plan)
        self.stepper.set_width(width, ordered=self.width.ordered)
        self.group = build_group(self.store, plan.generation, rank=width.group_rank(self.env.rank),
                                 world_size=width.size, backend=self.backend, timeout_s=self.config.pg_timeout_s,
                                 device=self.device, cancelled=self._watcher.moved)
        if self._mesh_spec is not None:
            self.mesh = build_mesh(self._mesh_spec, world_size=self.env.world_size, device=self.device)
        self.parts.on_generation(plan.generation, self.store)
        self._plan = plan
        self.recovery.timings["rendezvous_s"] = time.monotonic() - t0
        return _S.RESTORING

    def _restore(self) -> SupervisorState:
        plan, state = self._plan, self.state
        t0 = time.monotonic()
        if self._sharded is not None:
            # Before healing: the shards arrive into the new generation's module and optimizer.
            self._sharded.rebuild(self.mesh, self.device, state.optimizer)
        if plan.source is ResumeSource.LIVE:
            rerun = self.rerun if self.env.replacement else None  # a replacement takes over the newest record
            restore_live(plan, state=state, rank=self.env.rank, stepper=self.stepper, slots=self.slots,
                         device=self._comm_device, events=self.events, buddy=self.buddy,
                         snapshot=self.snapshot.snapshot if self.snapshot is not None else None,
                         adopt_record=(lambda: rerun.adopt_newest_record(self.store)) if rerun is not None else None)
        else:
            restore_from_disk(plan, state=state, rank=self.env.rank, stepper=self.stepper, disk=self.disk,
                              store=self.store, events=self.events, buddy=self.buddy,
                              timeout=self.config.join_timeout_s, steps=self.config.steps)
        self._fresh = self._new_process = False
        # A stop asked during the failed step or the recovery: every rank stops at this boundary, checkpointed
        # (agreed before the DDPs and the script's hook, whose collectives may not match across ranks).
        stop = state.step < self.config.steps and self.stepper.gate.agree_stop()
        self._rebuild_ddp(first=plan.source is ResumeSource.START)
        if self._on_new_group is not None:
            self._on_new_group()
            adopt_user_ddp(state.model, self.group, lambda: self.stepper.new_reducer(state.model.parameters()),  # type: ignore[arg-type]
                           plan.generation)  # a DDP the script built gets the plan's hook (an old one: a misuse)
        release_retired(self._retired)  # the script's DDPs of earlier generations are gone now (or a misuse was raised)
        self.parts.on_restored(state)
        self.recovery.timings["heal_s"] = time.monotonic() - t0
        self.recovery.report(plan, resume_step=state.step)
        return _S.PREEMPTING if stop else _S.TRAINING

    def _train(self, step_fn: StepFn) -> SupervisorState:
        state = self.state
        while state.step < self.config.steps:
            self.stepper.run_step(step_fn, state.step)
            state.step += 1
            self.judge.progress()
            self.stepper.end_boundary()
            self.parts.on_step_end(state)
            self._publish_grace()  # a save that took longer grows the default grace
            if self.stepper.width.group_rank(self.env.rank) == 0:  # rank 0, or an elastic job's lowest member
                self.events.emit("step_done", step=state.step, loss=self.stepper.loss.value(), generation=self.generation)
            if self.stepper.gate.stop_agreed and state.step < self.config.steps:
                return _S.PREEMPTING  # every rank read the same stop flag with this step's vote
            self.ctx.enter(Phase.BETWEEN_STEPS)
        return _S.FINISHING

    def _preempt(self) -> SupervisorState:
        """Every rank is at this boundary: its checkpoint, committed within the grace, then exit REQUEUE."""
        grace = self._publish_grace()  # fixed now; the agent's deadline is never before this rank's
        committed = checkpoint_for_preemption(
            self.state, preemption=self.preemption, grace=grace, rank=self.env.rank, store=self.store,
            events=self.events, enter=self.stepper.enter, disk=self._preemption_disk,
            prepare=not any(isinstance(part, DiskPart) for part in self.parts.parts), generation=self.generation,
            under_agent=self.env.under_agent)
        self._preempted = (self.state.step, committed)
        return _S.DONE

    def _preemption_disk(self) -> DiskCheckpoints:
        self.disk = self.disk or preemption_disk(
            self.run_dir, rank=self.env.rank, world_size=self.env.world_size, store=self.store, events=self.events,
            mesh_spec=self._mesh_spec, sharded=self._sharded is not None, suspended=self.stepper.gate.suspended,
            width=(lambda: self.stepper.width) if self.env.elastic else None)
        return self.disk

    def _publish_grace(self) -> float:
        """This rank's preemption grace, in the store for its agent whenever it changes."""
        longest, timeout = (d.longest_save_s, d.config.timeout_s) if (d := self.disk) else (0.0, DEFAULT_TIMEOUT_S)
        return self.preemption.publish_grace(self.store, self.env.rank, longest, timeout)

    def _finish(self) -> SupervisorState:
        self.stepper.enter("checkpoint", self.state.step)  # waiting for every rank, then for the final state
        width = self.stepper.width  # the final state's writer: rank 0, or an elastic job's lowest member
        finish_job(self.store, self.state, generation=self.generation, rank=width.group_rank(self.env.rank),
                   world_size=width.size, logical_ranks=self.env.world_size, moved=self._watcher.moved,
                   timeout=self.config.join_timeout_s, steps=self.config.steps,
                   run_dir=self.run_dir if self.config.write_final else None,
                   events=self.events, sharded=self._sharded.module if self._sharded is not None else None,
                   suspended=self.stepper.gate.suspended)
        return _S.DONE

    # ------------------------------------------------------------ groups
    def _release_group(self) -> None:
        """Drops every reference to the failed group this rank holds, then destroys it (group.release_group)."""
        self.stepper.reset_reducers()
        for wrapped, _ in self._ddps:
            wrapped.drop()
        if hasattr(self, "parts"):
            # After the reducers forgot their work: a pending error's frames hold the step's autograd graph,
            # whose Megatron functions hold their groups.
            self.parts.before_release()
        if self._sharded is not None:
            self._sharded.drop()
        release_mesh(self.mesh)
        self.mesh = None
        self.group = None
        release_group(self.device, retire=self.lifecycle.state is _S.RECOVERING, retired=self._retired,
                      held=lambda holders: self.events.emit("group_still_referenced", rank=self.env.rank,
                                                            generation=self.generation, holders=holders))

    def _rebuild_ddp(self, *, first: bool) -> None:
        for i, (wrapped, reducer) in enumerate(self._ddps):
            if reducer is None:
                reducer = self.stepper.new_reducer(wrapped.module.parameters(),
                                                   bucket_mb=wrapped.bucket_mb(self.config.chunk_mb))
                self._ddps[i] = (wrapped, reducer)
            assert self.group is not None
            wrapped.rebuild(self.group, reducer, first=first)

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------ failures
    def _judge(self, exc: BaseException) -> SupervisorState:
        """A failure: recover it, or stop the job (resilient_train.rank.recovery)."""
        outcome = self.recovery.judge(exc, step=self.ctx.step)
        if isinstance(outcome, JobStopped):
            self._stopped = outcome
            return _S.FAILED
        return self._stop_job(outcome) if outcome is not None else _S.RECOVERING

    def _stop_job(self, stop: Stop) -> SupervisorState:
        self._stopped = self.recovery.stop_job(stop, step=self.ctx.step, generation=self.generation)
        return _S.FAILED

    def _recover(self) -> SupervisorState:
        g = self.generation
        self._progress_generation = g + 1  # it left g: what it does from now on belongs to a later one
        self.stepper.enter("recovery", self.ctx.step)
        spent = self.recovery.leave(generation=g, step=self.ctx.step, phase=self.ctx.phase.value,
                                    release=self._release_failed)
        return self._stop_job(spent) if spent is not None else _S.JOINING

    def _release_failed(self) -> None:
        self._release_group()
        self.stepper.discard_gradients()
        if self.stepper.live is not None:
            self.stepper.guard.restore()  # a fault before the commit: forward may have changed buffers

    def _on_moved(self) -> None:
        """Watcher thread: the generation was declared failed; release the main thread from its collectives."""
        self.stepper.abort_reductions(f"generation {self.generation} was declared failed")
        if self.device.type == "cuda":  # NCCL can be aborted from another thread; gloo relies on closed sockets
            abort_nccl()
