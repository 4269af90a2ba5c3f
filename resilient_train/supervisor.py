"""The supervisor: runs a training loop inside a rank and keeps it alive.

A user hands it a step function and a :class:`TrainState`. The supervisor is
one loop over its lifecycle (:mod:`resilient_train.lifecycle`): join a
generation, restore, train, finish; on a fault, recover and join the next.
Each generation builds its process group on its own keys. A step commits only
when every rank voted for it in the gradient reduction
(:mod:`resilient_train.commit`), so after a fault every survivor is at a step
boundary; ranks that lost the state (replacements, a rank torn in its
optimizer update, a rank one step behind) heal from a live replica. Optional
parts (progress, chaos, disk checkpoints, host snapshots, CUPTI, rerun) plug
in through :mod:`resilient_train.parts`. See docs/design.md.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from chaos import Phase, loads_faults
from chaos.faults import RECOVERY_PHASES
from checkpointing import CheckpointConfig
from monitors import EventLog, ProgressReporter
from monitors.stacks import install_stack_dump
from resilient_train import env as envvars
from resilient_train import exitcodes
from resilient_train.config import SupervisorConfig
from resilient_train.buddy import BuddyCopies
from resilient_train.context import StepContext, StepFn
from resilient_train.ddp import ReplicatedModule, adopt_user_ddp, explain_ddp_before_run
from resilient_train.disk import DEFAULT_TIMEOUT_S, DiskCheckpoints, default_checkpoint_config
from resilient_train.errors import GenerationFailed, JobStopped, UsageError
from resilient_train.finish import finish_run, full_tensor, gather_sharded, write_final
from resilient_train.generation import JoinError, Membership, ResumePlan, ResumeSource, RunFinished
from resilient_train.group import abort_nccl, build_group, destroy_group, join_releases, release_in_background
from resilient_train.heal import receive_state, send_state
from resilient_train.judge import Judge, Stop
from resilient_train.lifecycle import Lifecycle, SupervisorState
from resilient_train.local_state import LocalSlots, encode_local
from resilient_train.preempt import Preemption
from resilient_train.mesh import MeshSpec, build_mesh, release_mesh
from resilient_train.parts import ChaosPart, CuptiPart, DiskPart, Part, Parts, ProgressPart, SnapshotPart
from resilient_train.reducer import GradientReducer
from resilient_train.rendezvous import enter_generation, interrupt_for_stop, leave_generation, stop_after_failure
from resilient_train.rerun.driver import RerunHooks
from resilient_train.rerun.part import RerunPart
from resilient_train.rerun.save import save_for_stop, shared_table
from resilient_train.sharded import Parallelize, ShardedModule
from resilient_train.shutdown import EXIT_RESERVE_S, publish_grace, record_preempted
from resilient_train.stepping import Stepper
from resilient_train.store import Keys, connect_worker_store, read_fault, read_stop, request_stop
from resilient_train.train_state import TrainState
from resilient_train.watch import GenerationWatcher

__all__ = ["GenerationFailed", "RunFinished", "StepContext", "Supervisor", "SupervisorConfig"]


_S = SupervisorState


class Supervisor:
    def __init__(self, config: SupervisorConfig, *, env: envvars.WorkerEnv | None = None) -> None:
        self.config = config
        self.env = env or envvars.WorkerEnv.from_environ()
        if config.reproducible:
            # cuBLAS is deterministic only with a fixed workspace, set before its first use.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if config.backend == "auto" else config.backend
        if self.backend == "nccl":
            torch.cuda.set_device(self.env.local_rank)
            self.device = torch.device("cuda", self.env.local_rank)
        else:
            self.device = torch.device("cpu")
        self.run_dir = Path(self.env.run_dir) if self.env.run_dir else None
        self.events = EventLog(self.run_dir / "events.jsonl" if self.run_dir else None, source=f"rank{self.env.rank}")
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
        self._gathered: dict[str, Any] | None = None
        # On SIGUSR2 every thread's stack goes to RUN_DIR/.monitors/rank{r}.stacks: the agent asks before it
        # kills a hung rank.
        self._stacks_file = install_stack_dump(self.run_dir, self.env.rank) if self.run_dir else None
        self.store = connect_worker_store(self.env, timeout=timedelta(seconds=config.join_timeout_s))
        self.slots = LocalSlots(self.store)
        explain_ddp_before_run(self.store, self.env.rank)

    # --------------------------------------------------------------- public
    def ddp(self, model: torch.nn.Module, **ddp_kwargs: Any) -> ReplicatedModule:
        """``model`` data-parallel: call what this returns as you would a DDP model.

        DDP is built again on every generation's group, its buckets the
        supervisor's fixed plan (bitwise across recoveries, overlapping
        backward, nothing copied). ``ddp_kwargs`` go to DDP.
        """
        wrapped = ReplicatedModule(model, ddp_kwargs, phase=lambda name: self.stepper.auto_phase(name))
        self._ddps.append((wrapped, None))
        return wrapped

    def add_part(self, part: Part) -> None:
        """Plugs ``part`` (an integration, such as Megatron's parallel state) into the loop; call before ``run``."""
        if not isinstance(part, Part):
            raise UsageError(f"add_part takes a resilient_train.parts.Part, got {type(part).__name__}")
        if hasattr(self, "parts"):
            raise UsageError("add_part must be called before run()")
        self._added.append(part)

    def sharded(self, model: torch.nn.Module, parallelize: Parallelize, *, mesh: MeshSpec | None = None) -> ShardedModule:
        """``model`` parallelised by ``parallelize(module, mesh)`` (``fully_shard``, ``parallelize_module``).

        Pass the model before it is parallelised, with its initial values: every
        generation the supervisor builds the mesh ``mesh`` describes on the new
        process group, applies ``parallelize`` to a fresh copy and moves this
        rank's shards into it (:mod:`resilient_train.sharded`). Call what this
        returns, and give it to ``TrainState(model=...)``.
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
            torch.set_num_threads(1)
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        if self._sharded is not None:
            self._check_sharded(state)
        self.state = state
        self.ctx = StepContext(self)
        self._on_new_group = on_new_group
        self.preemption = Preemption(self.config.preemption)  # SIGTERM/SIGUSR1 from here on: a stop at a boundary
        self._preempted: tuple[int, bool] | None = None  # (step, checkpoint committed) once stopped for one
        self._setup_parts(state)
        self.store.set(Keys.supervised(self.env.rank), str(os.getpid()))
        self._published_grace: float | None = None
        self._publish_grace()  # the agent's SIGKILL follows it (resilient_train.shutdown)
        self.events.emit("run_start", rank=self.env.rank, pid=os.getpid(), world_size=self.env.world_size,
                         replacement=self.env.replacement, steps=self.config.steps, since_spawn_s=_since_spawn())
        self._watcher = GenerationWatcher(self.store, rank=self.env.rank, interval_s=self.config.watch_interval_s,
                                          on_moved=self._on_moved)
        self._fresh = not self.env.replacement
        self._new_process = True
        self.judge = Judge(max_recoveries=self.config.max_recoveries,
                           max_failed_generations=self.config.max_failed_generations)
        self._failure: tuple[str, str, Any] | None = None  # (type name, message, Failure) of the last fault
        self._timings: dict[str, float] = {}
        self._moved_to: int | None = None  # the generation to join after a wake (joined without asking)
        self._woken_detection: dict[str, Any] | None = None  # its fault_detected, said once the join tells
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
                    self._say_woken_detection(None)
                    nxt = _S.DONE
                except Exception as exc:  # noqa: BLE001  (every failure goes through the same judgement)
                    try:
                        nxt = self._judge(exc)
                    except dist.DistNetworkError as lost:  # the judgement needs the store, and it is gone
                        self._store_lost = str(lost).splitlines()[0][:200]
                        nxt = _S.FAILED
                self.lifecycle.to(nxt)
        finally:
            self.preemption.close()
            self._watcher.close()
            self.stepper.close()
            self._release_group()
            self._release_retired()
            if self.disk is not None and self.parts.of(DiskPart) is None:
                self.disk.close()  # the preemption-only checkpoints
            join_releases(_RELEASE_AT_EXIT_S)
            for part, error in self.parts.close():
                self.events.emit("part_close_failed", rank=self.env.rank, part=part, error=error[:500])
                if self._store_lost is None:  # without the store every part fails to close: one line says why
                    print(f"resilient-train: rank {self.env.rank}: {part} did not close cleanly: "
                          f"{error.splitlines()[0]}", file=sys.stderr, flush=True)
        if self._store_lost is not None:
            self.events.emit("run_end", rank=self.env.rank, pid=os.getpid(), step=state.step,
                             recoveries=self.judge.recoveries, store_lost=self._store_lost)
            if not self.env.under_agent:  # under the agent, its line says it for the node
                print(f"resilient-train: rank {self.env.rank}: lost the coordination store ({self._store_lost}): "
                      "stopping; start the job again to resume from its newest checkpoint", file=sys.stderr, flush=True)
            raise SystemExit(exitcodes.FAILED)
        if self._stopped is not None:
            self.events.emit("run_end", rank=self.env.rank, pid=os.getpid(), step=state.step,
                             recoveries=self.judge.recoveries, stopped=self._stopped.reason)
            raise SystemExit(self._stopped.exit_code)
        if self._preempted is not None:
            self.events.emit("run_end", rank=self.env.rank, pid=os.getpid(), step=state.step,
                             recoveries=self.judge.recoveries, preempted=True)
            raise SystemExit(exitcodes.REQUEUE)
        self.events.emit("run_end", rank=self.env.rank, pid=os.getpid(), step=state.step, recoveries=self.judge.recoveries)
        return state

    # ---------------------------------------------------------------- parts
    def _setup_parts(self, state: TrainState) -> None:
        c, rank = self.config, self.env.rank
        parts: list[Part] = list(self._added)
        chaos = ChaosPart(loads_faults(os.environ.get(envvars.RT_CHAOS, "")), rank=rank, store=self.store,
                          run_dir=self.run_dir, events=self.events, step=lambda: self.ctx.step)
        if chaos:  # before progress: a rank stopped "at" a phase has not entered it
            parts.append(chaos)
        if self.run_dir is not None:
            # Written by the main thread only, at every phase change: the agent's hang detector reads it.
            parts.append(ProgressPart(ProgressReporter(
                self.run_dir, rank, cuda_device=self.device if self.device.type == "cuda" else None),
                generation=lambda: self._progress_generation))
        if c.cupti is not None:
            parts.append(CuptiPart(c.cupti, self.events))
        self.disk = self._disk_checkpoints(c.checkpoint) if c.checkpoint is not None else None
        if self.disk is None and self.run_dir is not None and (self.run_dir / "checkpoints").is_dir():
            # Checkpoints without a checkpoint config: a preemption's (resilient_train.preempt), to resume from.
            self.disk = self._disk_checkpoints(default_checkpoint_config(self.run_dir, every=0, mode="disabled"))
        if self.disk is not None:
            parts.append(DiskPart(self.disk, self._enter, steps=c.steps))
        self.snapshot: SnapshotPart | None = None
        if c.snapshot_every is not None:
            self.snapshot = SnapshotPart(c.snapshot_every, self._snapshot_local)
            parts.append(self.snapshot)
        self.rerun: RerunPart | None = None
        if c.rerun.enabled:
            hooks = RerunHooks(exchange=self._exchange, rewind=lambda step: self.stepper.rewind(step), save=self._save_for_stop,
                               exit=_exit, publish=lambda key, value: self.store.set(key, value))
            self.rerun = RerunPart(c.rerun, rank=rank, world_size=self.env.world_size, emit=self.events.emit,
                                   hooks=hooks, device_index=self.device.index if self.device.type == "cuda" else None)
            state.runtime["rerun"] = self.rerun.driver.stateful()  # in the published local state and checkpoints
            parts.append(self.rerun)
        if self._sharded is not None and self._mesh_spec is not None:
            spec, world = self._mesh_spec, self.env.world_size
            classes = [spec.replica_class(r, world) for r in range(world)]
            if world > 1 and any(classes.count(c) == 1 for c in classes):
                # A shard nobody else holds: its buddy keeps a copy (resilient_train.buddy).
                self.buddy = BuddyCopies(every=c.buddy_every, rank=rank, world_size=world,
                                         payload=lambda: self.state.shard_state_dict(),
                                         publish_local=self._publish_snapshot_local, device=self._comm_device,
                                         events=self.events, corrupt_at=_corrupt_at())
                parts.append(self.buddy)
        self.parts = Parts(parts)
        self.stepper = Stepper(state=state, ctx=self.ctx, parts=self.parts, rerun=self.rerun, slots=self.slots,
                               events=self.events, world_size=self.env.world_size, device=self.device,
                               chunk_mb=c.chunk_mb, group=lambda: self.group, stop=self.preemption.flag,
                               force_reduction=c.force_reduction,
                               moved=lambda: self._watcher.moved.is_set(),
                               training=lambda: self.lifecycle.state is _S.TRAINING)
        if self.env.replacement:
            self.stepper.live = None  # a replacement holds nothing until it is healed

    def _disk_checkpoints(self, config: CheckpointConfig) -> DiskCheckpoints:
        """Sharded state goes to disk in DCP's form, each rank its own chunks: the first member of each replica
        class writes the class's (resilient_train.dcp_state)."""
        rank, world, spec = self.env.rank, self.env.world_size, self._mesh_spec
        return DiskCheckpoints(config, rank=rank, world_size=world, store=self.store, events=self.events,
                               run_dir=self.run_dir, sharded=self._sharded is not None,
                               first_replica=spec.first_replica(rank, world) if spec is not None else True,
                               suspended=lambda: self.stepper.gate.suspended())

    # ------------------------------------------------------------ lifecycle
    def _join(self) -> SupervisorState:
        self._enter("startup" if self._fresh else "recovery", self.state.step)
        t0 = time.monotonic()

        def me() -> Membership:
            snap = self.snapshot.snapshot.step if self.snapshot is not None else None
            spec = self._mesh_spec
            return Membership(rank=self.env.rank, pid=os.getpid(), live_step=self.stepper.live, snapshot_step=snap,
                              local_steps=self.slots.steps(self.env.rank), replacement=self.env.replacement,
                              fresh=self._fresh, new_process=self._new_process,
                              replica_class=spec.replica_class(self.env.rank, self.env.world_size) if spec else 0,
                              own_steps=self.buddy.own_steps() if self.buddy is not None else [],
                              buddy_steps=self.buddy.offered() if self.buddy is not None else {})

        moved_to, self._moved_to = self._moved_to, None
        plan = enter_generation(self.store, world_size=self.env.world_size, me=me,
                                timeout=self.config.join_timeout_s, stopped=self._raise_if_stopped, moved_to=moved_to)
        self._say_woken_detection(plan)
        self.generation = self._progress_generation = plan.generation
        self._watcher.watch(plan.generation)
        self._enter(Phase.RENDEZVOUS.value, plan.step if plan.step is not None else self.state.step)
        self.group = build_group(self.store, plan.generation, rank=self.env.rank, world_size=self.env.world_size,
                                 backend=self.backend, timeout_s=self.config.pg_timeout_s, device=self.device)
        if self._mesh_spec is not None:
            self.mesh = build_mesh(self._mesh_spec, world_size=self.env.world_size, device=self.device)
        self.parts.on_generation(plan.generation, self.store)
        self._plan = plan
        self._timings["rendezvous_s"] = time.monotonic() - t0
        return _S.RESTORING

    def _restore(self) -> SupervisorState:
        plan, state = self._plan, self.state
        t0 = time.monotonic()
        if self._sharded is not None:
            # Before healing: the shards arrive into the new generation's module and optimizer.
            self._sharded.rebuild(self.mesh, self.device, state.optimizer)
        if plan.source is ResumeSource.LIVE:
            self._heal(plan)
        else:
            self._load_from_disk(plan)
        self._fresh = self._new_process = False
        self._rebuild_ddp(first=plan.source is ResumeSource.START)
        if self._on_new_group is not None:
            self._on_new_group()
            # A DDP the script builds itself is built here: it gets the plan's hook, and one kept from an
            # earlier generation is a misuse (the search walks the heap: only where it can find something).
            adopt_user_ddp(state.model, self.group, lambda: self.stepper.new_reducer(state.model.parameters()),  # type: ignore[arg-type]
                           plan.generation)
        self._release_retired()  # the script's DDPs of earlier generations are gone now (or a misuse was raised)
        self.parts.on_restored(state)
        self._timings["heal_s"] = time.monotonic() - t0
        self._report_recovery(plan)
        return _S.TRAINING

    def _train(self, step_fn: StepFn) -> SupervisorState:
        state = self.state
        while state.step < self.config.steps:
            self.stepper.run_step(step_fn, state.step)
            state.step += 1
            self.judge.progress()
            self.stepper.end_boundary()
            self.parts.on_step_end(state)
            self._publish_grace()  # a save that took longer grows the default grace
            if self.env.rank == 0:
                self.events.emit("step_done", step=state.step, loss=self.stepper.loss.value(), generation=self.generation)
            if self.stepper.gate.stop_agreed and state.step < self.config.steps:
                return _S.PREEMPTING  # every rank read the same stop flag with this step's vote
            self.ctx.enter(Phase.BETWEEN_STEPS)
        return _S.FINISHING

    def _preempt(self) -> SupervisorState:
        """Every rank is at this boundary: its checkpoint, committed within the grace, then exit REQUEUE."""
        state, rank = self.state, self.env.rank
        grace = self._publish_grace()  # fixed now; the agent's deadline is never before this rank's
        deadline = self.preemption.deadline(grace)
        self.events.emit("preempting", rank=rank, step=state.step, signal=self.preemption.signal, grace_s=grace)
        record_preempted(self.store, rank, step=state.step, committed=None)
        self._enter("checkpoint", state.step)
        if self.disk is None:
            if self.run_dir is None:
                raise UsageError("preempted without a run directory to write the checkpoint to")
            self.disk = self._disk_checkpoints(default_checkpoint_config(self.run_dir, every=0, mode="disabled"))
        if not any(isinstance(part, DiskPart) for part in self.parts.parts):
            self.disk.on_generation(self.store, self.generation)  # a DiskPart would have done both
            self.disk.prepare(state)
        committed = self.disk.save_now(state, deadline=deadline, exit_by=deadline + EXIT_RESERVE_S)
        record_preempted(self.store, rank, step=state.step, committed=committed)
        self._preempted = (state.step, committed)
        self.events.emit("preempted", rank=rank, step=state.step, checkpoint_committed=committed,
                         signal=self.preemption.signal)
        if rank == 0 and not self.env.under_agent:  # the agent says it once for its node
            how = "its checkpoint is committed" if committed else f"its checkpoint did not commit within {grace:g} s"
            print(f"resilient-train: preempted: every rank stopped at step {state.step}; {how}; "
                  f"start the job again to resume (exit code {exitcodes.REQUEUE})", file=sys.stderr, flush=True)
        return _S.DONE

    def _publish_grace(self) -> float:
        """This rank's preemption grace, in the store for its agent whenever it changes."""
        disk = self.disk
        grace = self.preemption.grace_s(disk.longest_save_s if disk is not None else 0.0,
                                        disk.config.timeout_s if disk is not None else DEFAULT_TIMEOUT_S)
        if grace != self._published_grace:
            publish_grace(self.store, self.env.rank, grace)
            self._published_grace = grace
        return grace

    def _finish(self) -> SupervisorState:
        self._enter("checkpoint", self.state.step)  # waiting for every rank, then for the final state
        writes = self.config.write_final and self.run_dir is not None
        finish_run(
            self.store, generation=self.generation, rank=self.env.rank, world_size=self.env.world_size,
            moved=self._watcher.moved, timeout=self.config.join_timeout_s,
            write_final=self._write_final if writes else None,
            gather=self._gather_sharded if writes and self._sharded is not None else None,
        )
        return _S.DONE

    # ------------------------------------------------------------- restore
    def _heal(self, plan: ResumePlan) -> None:
        state, rank, step = self.state, self.env.rank, plan.step
        assert step is not None
        self._enter(Phase.HEAL.value, step)
        if rank in plan.from_snapshot:
            if self.snapshot is not None and self.snapshot.snapshot.step == step:
                state.load_replicated(self.snapshot.snapshot.replicated())
            else:
                assert self.buddy is not None
                state.load_shard_state(self.buddy.own_copy(step).state())
        # One order on every rank (by target), so a rank that both serves and receives never waits on a peer
        # that waits on it. A buddy holder serves its host copy; a live source, what it holds.
        transfers = sorted([(t, s, False) for t, s in plan.heal_from.items()] +
                           [(t, h, True) for t, h in plan.buddy_from.items()])
        sent = received = 0
        source_of: int | None = None
        for target, source, from_buddy in transfers:
            if source == rank:
                assert not from_buddy or self.buddy is not None
                payload = self.buddy.copy_of(target, step).state() if from_buddy else state.shard_state_dict()  # type: ignore[union-attr]
                sent += send_state(payload, target, device=self._comm_device)
            elif target == rank:
                self.stepper.live = None  # torn until the whole state arrived
                healed, received = receive_state(source, device=self._comm_device)
                state.load_shard_state(healed)
                source_of = source
        state.load_local(self.slots.read_decoded(rank, step))
        if self.rerun is not None and self.env.replacement:
            self.rerun.adopt_newest_record(self.store)
        assert state.step == step, (state.step, step)
        if self.buddy is not None:
            self.buddy.resumed(step)
        self.stepper.restored(step)
        if sent or received or rank in plan.from_snapshot:
            self.events.emit("healed", rank=rank, step=step, generation=plan.generation, bytes_sent=sent,
                             bytes_received=received, from_rank=source_of,
                             from_buddy=rank in plan.buddy_from, from_own_copy=rank in plan.from_snapshot)

    def _load_from_disk(self, plan: ResumePlan) -> None:
        state = self.state
        loaded = None
        if self.disk is not None:
            self._enter("load", state.step)
            self.stepper.live = None
            loaded = self.disk.load_agreed(state, self.store, plan.generation, timeout=self.config.join_timeout_s)
        if loaded is None and plan.source is ResumeSource.DISK:
            raise JoinError("no live replica holds a recoverable step and there is no checkpoint to fall back on")
        if loaded is not None:
            if self.buddy is not None:
                self.buddy.resumed(loaded)  # copies of later boundaries belong to steps that are redone
            self.events.emit("resumed_from_disk", rank=self.env.rank, step=loaded, generation=plan.generation)
            if self.env.rank == 0:
                print(f"resilient-train: resumed from the checkpoint of step {loaded}", file=sys.stderr, flush=True)
        self.stepper.publish_local(state.step)
        self.stepper.restored(state.step)

    def _release_group(self) -> None:
        """Drops every reference to the failed group, then destroys it.

        A gloo group closes its connections only when its last reference goes:
        while a DDP, a pending reduction or a frame holds it, peers blocked in a
        collective with this rank wait for the full group timeout instead of
        failing at once. The last reference is dropped on a daemon thread: the
        destructor waits for gloo's worker threads, and one may sit in a
        collective that only the timeout ends (seen at 4 ranks: 30 s).
        """
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
        box = [g] if (g := destroy_group(self.device)) is not None else []
        del g
        gc.collect()
        if box and sys.getrefcount(box[0]) > 2:  # the box and getrefcount's own argument
            # Something else holds the group (a DDP built by the script, a frame): its connections stay
            # open, and peers blocked in a collective with this rank wait for the group's timeout.
            holders = sorted({type(r).__name__ for r in gc.get_referrers(box[0])} - {"list", "frame"})
            self.events.emit("group_still_referenced", rank=self.env.rank, generation=self.generation,
                             holders=holders)
            if self.lifecycle.state is _S.RECOVERING:
                # The box keeps the group alive until the script's next on_new_group has replaced its DDP.
                # Otherwise the DDP's reducer would hold the last reference, and the script dropping it would
                # run the group's destructor on the main thread with the GIL held: it joins gloo's worker
                # threads, and one still in a collective of the failed step waits for the GIL to run that
                # collective's Python callback: a deadlock (seen at 3 ranks, rank killed at the vote).
                self._retired.append(box)
                return
        release_in_background(box)

    def _release_retired(self) -> None:
        """Drops the failed groups held past their generation, on daemon threads (see _release_group)."""
        retired, self._retired = self._retired, []
        for box in retired:
            release_in_background(box)

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
        """A failure: recover it, or stop the job (a bug, a misuse, a full disk, no progress)."""
        self._say_woken_detection(None)
        stop = stop_after_failure(self.store, self._watcher) if not isinstance(exc, JobStopped) else None
        if isinstance(exc, JobStopped) or (stop is not None and stop.get("rank") != self.env.rank):
            self._stopped = exc if isinstance(exc, JobStopped) else JobStopped(stop["summary"], int(stop["exit_code"]))
            return _S.FAILED
        verdict = self.judge.failure(exc, step=self.ctx.step, generation_moved=self._watcher.moved.is_set())
        # The exception may live on (a reduction's future keeps it): its frames' locals (the step's loss, and
        # through its autograd graph every group a Megatron function saved) must not.
        traceback.clear_frames(exc.__traceback__)
        if isinstance(verdict, Stop):
            return self._stop_job(verdict)
        # Only text: the exception's frames hold tensors and the failed group's work, which must be freed.
        self._failure = (type(exc).__name__, str(exc), verdict)
        return _S.RECOVERING

    def _stop_job(self, stop: Stop) -> SupervisorState:
        """Stops the whole job; the original traceback (if any) and the reason are said once."""
        stood = request_stop(self.store, {"rank": self.env.rank, "summary": stop.reason, "exit_code": stop.exit_code,
                                          "step": self.ctx.step, "generation": self.generation})
        interrupt_for_stop(self.store, world_size=self.env.world_size)
        if stood.get("rank") == self.env.rank and stood.get("summary") == stop.reason:
            sys.stderr.write(stop.traceback)
            if not self.env.under_agent:  # the agent says it once for the job
                print(f"resilient-train: rank {self.env.rank} stopped the job: {stop.reason}", file=sys.stderr,
                      flush=True)
            self.events.emit("job_stopped", rank=self.env.rank, reason=stop.reason, exit_code=stop.exit_code,
                             step=self.ctx.step, generation=self.generation, traceback=stop.traceback[-4000:])
        self._stopped = JobStopped(stood.get("summary", stop.reason), int(stood.get("exit_code", stop.exit_code)))
        return _S.FAILED

    def _say_woken_detection(self, plan: ResumePlan | None) -> None:
        """A woken rank's ``fault_detected``, once its join answered (``plan``) or failed (None), with the
        cause that stands; none if the wake was a stop's (no fault was recorded), and no recovery counted."""
        detection, self._woken_detection = self._woken_detection, None
        if detection is None:
            return
        g = detection["generation"]
        # The plan carries the cause of the generation before it: this fault's only if it is g + 1's plan.
        cause = plan.cause if plan is not None and plan.generation == g + 1 else read_fault(self.store, g)
        if plan is None and cause is None:
            self.judge.not_recovering()
            return
        self.events.emit("fault_detected", **(detection | {"cause": cause}))

    def _raise_if_stopped(self) -> None:
        stop = read_stop(self.store)
        if stop is not None:
            raise JobStopped(stop["summary"], int(stop["exit_code"]))

    def _recover(self) -> SupervisorState:
        assert self._failure is not None
        kind, message, failure = self._failure
        g = self.generation
        self._progress_generation = g + 1  # it left g: what it does from now on belongs to a later one
        self._enter("recovery", self.ctx.step)
        t_detect = time.time()
        first, cause, self._moved_to = leave_generation(
            self.store, g, {"rank": self.env.rank, "kind": kind, "time": t_detect, "step": self.ctx.step,
                            "phase": self.ctx.phase.value, **failure.to_dict()},
            world_size=self.env.world_size, watcher=self._watcher)
        detection = {"rank": self.env.rank, "generation": g, "step": self.ctx.step, "phase": self.ctx.phase.value,
                     "kind": kind, "error": message[:300], "failure": failure.kind.value, "first_reporter": first,
                     "cause": cause, "time": t_detect}
        if self._moved_to is None:
            self.events.emit("fault_detected", **detection)
        else:  # woken, by a fault or by a stop: the next join tells which (a stopped rank detected no fault)
            self._woken_detection = detection
        t0 = time.monotonic()
        if g >= 0 and not self._watcher.wait_handled(self.config.pg_timeout_s):
            # The generation moved (declared above) but the watcher has not finished acting on it: its NCCL
            # abort would race the release below (expected only when the store stops answering).
            self.events.emit("watcher_late", rank=self.env.rank, generation=g, waited_s=self.config.pg_timeout_s)
        self._release_group()
        self.stepper.discard_gradients()
        if self.stepper.live is not None:
            self.stepper.guard.restore()  # a fault before the commit: forward may have changed buffers
        spent = self.judge.recovering(failure)
        if spent is not None:
            self._say_woken_detection(None)
            return self._stop_job(spent)
        self._timings = {"t_detect": t_detect, "abort_s": time.monotonic() - t0, "fault_step": float(self.ctx.step)}
        if cause is not None:
            self._timings["fault_time"] = float(cause.get("time", t_detect))
        return _S.JOINING

    def _report_recovery(self, plan: ResumePlan) -> None:
        if "t_detect" not in self._timings:
            return  # a fresh start, not a recovery
        t = self._timings
        fault_time = t.get("fault_time", float((plan.cause or {}).get("time", t["t_detect"])))
        # Where the state stands now, whatever restored it: a live replica, a host snapshot or a buddy copy
        # (plan.step), or the checkpoint all ranks agreed to load (plan.step is None for a disk resume).
        resume = self.state.step
        self.events.emit(
            "recovery_done", rank=self.env.rank, generation=plan.generation, resume_step=resume,
            resume_from=plan.source.value, replacements=plan.replacements, healed=plan.healed,
            detect_s=max(0.0, t["t_detect"] - fault_time),
            abort_s=t["abort_s"], rendezvous_s=t["rendezvous_s"], heal_s=t["heal_s"],
            steps_redone=max(0, int(t["fault_step"]) - resume),
        )
        self._timings = {}

    # ---------------------------------------------------------- entry points
    def _enter(self, phase: str, step: int) -> None:
        if self._watcher.moved.is_set() and phase in _STEP_PHASES:
            raise GenerationFailed(f"generation {self.generation} was declared failed")
        self.parts.on_phase(phase, step)

    def _reduce_gradients(self) -> None:
        self.stepper.reduce_gradients()

    def _on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.parts.on_loss(loss, self.ctx.step, self.ctx.data_rank)

    def _on_moved(self) -> None:
        """Watcher thread: the generation was declared failed; release the main thread from its collectives."""
        self.stepper.abort_reductions(f"generation {self.generation} was declared failed")
        self._abort_nccl()

    def _abort_nccl(self) -> None:
        # NCCL can be aborted from another thread; gloo cannot, and relies on the dead peer's closed sockets.
        if self.device.type == "cuda":
            abort_nccl()

    # ------------------------------------------------------------- helpers
    def _snapshot_local(self) -> bytes:
        payload = encode_local(self.state.local_state_dict())
        self.slots.publish(self.env.rank, self.state.step, payload, snapshot=True)
        return payload

    def _exchange(self, row: list[float]) -> list[list[float]]:
        return shared_table(row, rank=self.env.rank, world_size=self.env.world_size, device=self.device)

    def _save_for_stop(self, step: int) -> str | None:
        return save_for_stop(self.store, self.state, step, rank=self.env.rank, world_size=self.env.world_size,
                             generation=self.generation, run_dir=self.run_dir,
                             timeout_s=self.config.rerun.stop_timeout_s)

    def _publish_snapshot_local(self, step: int) -> None:
        sd = self.state.local_state_dict()
        sd["step"] = step
        self.slots.publish(self.env.rank, step, encode_local(sd), snapshot=True)

    def _check_sharded(self, state: TrainState) -> None:
        c = self.config
        if state.model is not self._sharded:
            raise UsageError("TrainState(model=...) must be the module sup.sharded returned")
        if c.snapshot_every is not None:
            raise UsageError("snapshot_every with sup.sharded: sharded state is covered by replicas and buddy "
                             "copies (SupervisorConfig.buddy_every)")
        if c.rerun.enabled:
            raise UsageError("the rerun machine does not support sup.sharded yet")

    def _gather_sharded(self) -> None:
        """Every rank: the sharded model and optimizer as DTensors (DCP's state_dict API); rank 0 streams them
        whole to disk one tensor at a time (:meth:`_write_final`), the others run the same gathers meanwhile."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        assert self._sharded is not None
        state = self.state
        with self.stepper.gate.suspended():  # DCP may step an optimizer with no state yet, to create it
            model_sd, optim_sd = get_state_dict(self._sharded.module, state.optimizer or [],
                                                options=StateDictOptions(full_state_dict=False))
        sharded: dict[str, Any] = {"model": model_sd}
        if state.optimizer is not None:
            sharded["optimizer"] = optim_sd
        if state.replicated:
            sharded["replicated"] = {name: obj.state_dict() for name, obj in state.replicated.items()}
        if self.env.rank == 0:
            self._gathered = sharded
        else:
            gather_sharded(sharded)

    def _write_final(self) -> None:
        assert self.run_dir is not None
        t0 = time.monotonic()
        sharded = self._sharded is not None
        path = write_final(self.store, self.state, self.run_dir, steps=self.config.steps,
                           world_size=self.env.world_size, replicated=self._gathered if sharded else None,
                           materialize=full_tensor if sharded else None)
        self._gathered = None
        self.events.emit("final_state_written", path=str(path), step=self.config.steps,
                         seconds=round(time.monotonic() - t0, 3))


_RELEASE_AT_EXIT_S = 5.0  # a group still stuck in a collective after this is left to the process's exit
_STEP_PHASES = frozenset(p.value for p in Phase if p not in RECOVERY_PHASES)


def _exit(code: int) -> Any:
    raise SystemExit(code)


def _corrupt_at() -> tuple[int, int] | None:
    """Tests: ``RT_TEST_CORRUPT_BUDDY=RANK@STEP`` flips a bit of the buddy copy RANK receives at STEP."""
    spec = os.environ.get(envvars.RT_TEST_CORRUPT_BUDDY, "")
    if not spec:
        return None
    rank, step = spec.split("@")
    return int(rank), int(step)


def _since_spawn() -> float | None:
    """Seconds from the agent starting this worker to its run starting (None without an agent)."""
    spawned = os.environ.get(envvars.RT_SPAWNED_AT)
    return round(time.time() - float(spawned), 3) if spawned else None
