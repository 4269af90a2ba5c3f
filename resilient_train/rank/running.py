"""One call of :meth:`Supervisor.run <resilient_train.rank.supervisor.Supervisor.run>`: what it builds and
learns, and the loop over its lifecycle.

The :class:`~resilient_train.rank.supervisor.Supervisor` holds what a script
gives it before the run (its config, its models, its parts) and what its
process has from the start (its environment, its store, its event log). A
:class:`Run` holds the rest: the parts built for the run, the watcher, the
judge and the recovery, the generation and its group and mesh, and what the
run learns on its way (how it stopped, whether the store is lost, the plan it
resumed with). It exists from the first line of ``run`` to its last: nothing
of it is there before (``add_part`` asks whether a run began), and a state
handler never meets an attribute that is not set yet.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from chaos import Phase
from monitors import EventLog
from resilient_train.protocol import env as envvars
from resilient_train.protocol.store import Keys
from resilient_train.rank.assemble import build_parts, preemption_disk
from resilient_train.rank.config import SupervisorConfig
from resilient_train.rank.context import StepFn
from resilient_train.rank.ddp import ReplicatedModule, adopt_user_ddp
from resilient_train.rank.disk import DEFAULT_TIMEOUT_S, DiskCheckpoints
from resilient_train.rank.elastic.rank import RankWidth
from resilient_train.rank.errors import JobStopped
from resilient_train.rank.finish import close_failed, end_run, finish_job
from resilient_train.rank.generation import (
    RankMembership,
    ResumePlan,
    ResumeSource,
    RunFinished,
)
from resilient_train.rank.group import (
    RELEASE_AT_EXIT_S,
    abort_nccl,
    build_group,
    join_releases,
    release_group,
    release_retired,
)
from resilient_train.rank.heal import restore_from_disk, restore_live
from resilient_train.rank.judge import Judge, Stop
from resilient_train.rank.lifecycle import Lifecycle, SupervisorState
from resilient_train.rank.local_state import LocalSlots
from resilient_train.rank.mesh import MeshSpec, build_mesh, release_mesh
from resilient_train.rank.parts import DiskPart, Part
from resilient_train.rank.preempt import Preemption, checkpoint_for_preemption
from resilient_train.rank.recovery import Recovery, stop_on_storage_fault
from resilient_train.rank.reducer import GradientReducer
from resilient_train.rank.rendezvous import enter_generation, join_interruptibly
from resilient_train.rank.sharded import ShardedModule
from resilient_train.rank.storefollow import judge_following
from resilient_train.rank.train_state import TrainState
from resilient_train.rank.watch import GenerationWatcher

__all__ = ["Prepared", "Run"]

_S = SupervisorState


class Prepared(Protocol):
    """What a run takes from its supervisor (resilient_train.rank.supervisor.Supervisor): set before it."""

    config: SupervisorConfig
    env: envvars.WorkerEnv
    events: EventLog
    store: dist.Store
    backend: str
    device: torch.device
    run_dir: Path | None
    slots: LocalSlots
    width: RankWidth
    _join_store: dist.Store
    _ddps: list[tuple[ReplicatedModule, GradientReducer | None]]
    _added: list[Part]
    _sharded: ShardedModule | None
    _mesh_spec: MeshSpec | None


class Run:
    def __init__(self, sup: Prepared, step_fn: StepFn, state: TrainState,
                 on_new_group: Callable[[], None] | None) -> None:
        # What the supervisor had before the run (shared, never replaced during it).
        self.config, self.env, self.events, self.store = sup.config, sup.env, sup.events, sup.store
        self.backend, self.device, self.run_dir = sup.backend, sup.device, sup.run_dir
        self.slots, self.width, self._join_store = sup.slots, sup.width, sup._join_store
        self._ddps, self._added, self._sharded, self._mesh_spec = sup._ddps, sup._added, sup._sharded, sup._mesh_spec
        self._step_fn = step_fn
        self.lifecycle = Lifecycle()
        self.generation = -1
        self._progress_generation = -1  # the generation the rank is in, or heading to once it left one
        self.group: dist.ProcessGroup | None = None
        self._retired: list[list[dist.ProcessGroup]] = []  # failed groups still held by the script (_release_group)
        self.mesh: Any = None  # the current generation's DeviceMesh (sup.sharded)
        self._plan: ResumePlan | None = None
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
        self._handlers: dict[SupervisorState, Callable[[], SupervisorState]] = {
            _S.JOINING: self._join, _S.RESTORING: self._restore, _S.TRAINING: lambda: self._train(self._step_fn),
            _S.FINISHING: self._finish, _S.RECOVERING: self._recover, _S.PREEMPTING: self._preempt,
        }

    def loop(self) -> TrainState:
        """Runs the step function until ``state.step == config.steps``, through faults; the final state."""
        self.lifecycle.to(_S.JOINING)
        try:
            while self.lifecycle.state not in (_S.DONE, _S.FAILED):
                try:
                    nxt = self._handlers[self.lifecycle.state]()
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
        code = end_run(self.events, rank=self.env.rank, step=self.state.step, recoveries=self.judge.recoveries,
                       under_agent=self.env.under_agent, store_lost=self._store_lost, stopped=self._stopped,
                       preempted=self._preempted is not None)
        if code is not None:
            raise SystemExit(code)
        return self.state

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
