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
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from chaos import Fault, Phase, loads_faults
from chaos.faults import RECOVERY_PHASES
from checkpointing import CheckpointConfig, is_disk_full
from monitors import EventLog, ProgressReporter
from monitors.cupti_kernels import CuptiConfig
from monitors.stacks import install_stack_dump
from resilient_train import env as envvars
from resilient_train import exitcodes
from resilient_train.commit import BufferGuard, CommitGate, StepRejected
from resilient_train.context import StepContext, StepFn
from resilient_train.ddp import ReplicatedModule, adopt_user_ddp
from resilient_train.disk import DiskCheckpoints
from resilient_train.errors import FailureKind, GenerationFailed, JobStopped, UsageError, classify
from resilient_train.finish import finish_run, published_local_states
from resilient_train.generation import JoinError, Membership, ResumePlan, ResumeSource, RunFinished, join_generation
from resilient_train.group import abort_nccl, build_group, destroy_group
from resilient_train.heal import receive_state, send_state
from resilient_train.lifecycle import Lifecycle, SupervisorState
from resilient_train.local_state import LocalSlots, encode_local
from resilient_train.parts import ChaosPart, CuptiPart, DiskPart, Part, Parts, ProgressPart, SnapshotPart
from resilient_train.reducer import DEFAULT_CHUNK_MB, GradientReducer, ReducerHooks
from resilient_train.rerun import RerunConfig
from resilient_train.rerun.driver import Outcome, RerunHooks
from resilient_train.rerun.part import ComputeMode, RerunPart
from resilient_train.rerun.save import save_for_stop, shared_table
from resilient_train.store import Keys, connect_worker_store, declare_fault, read_fault, read_stop, request_stop
from resilient_train.train_state import TrainState
from resilient_train.watch import GenerationWatcher

__all__ = ["GenerationFailed", "RunFinished", "StepContext", "Supervisor", "SupervisorConfig"]


@dataclass(kw_only=True)
class SupervisorConfig:
    steps: int
    backend: str = "auto"  # "gloo", "nccl", or "auto" (nccl when CUDA is available)
    pg_timeout_s: float = 30.0  # gloo cannot be aborted: this bounds a collective stuck on a silent peer
    join_timeout_s: float = 120.0
    max_recoveries: int = 32  # in the whole run
    max_failed_generations: int = 8  # in a row without a completed step: then the job stops
    # Deterministic algorithms and one intra-op thread: bitwise verdicts (the chaos runner, the demo, the tests).
    reproducible: bool = field(default_factory=lambda: os.environ.get(envvars.RT_REPRODUCIBLE) == "1")
    snapshot_every: int | None = None  # a host snapshot every k steps (off: live replicas are the redundancy)
    chunk_mb: float = DEFAULT_CHUNK_MB  # the gradient reduction's chunk size (fixed for the run)
    write_final: bool = True
    checkpoint: CheckpointConfig | None = None  # disk checkpoints (see resilient_train.disk)
    watch_interval_s: float = 0.05
    rerun: RerunConfig = field(default_factory=RerunConfig)  # result validation and re-runs (resilient_train.rerun)
    # NVRx's CUPTI kernel scores, reported as events (needs the nvrx extra and CUDA; monitors.cupti_kernels)
    cupti: CuptiConfig | None = None

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1 or None, got {self.snapshot_every}")
        if self.max_failed_generations < 1:
            raise ValueError(f"max_failed_generations must be >= 1, got {self.max_failed_generations}")
        if not self.chunk_mb > 0:
            raise ValueError(f"chunk_mb must be > 0, got {self.chunk_mb}")


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
        self.group: dist.ProcessGroup | None = None
        self.recoveries = 0
        self._ddps: list[tuple[ReplicatedModule, GradientReducer | None]] = []
        # On SIGUSR1 every thread's stack goes to RUN_DIR/.monitors/rank{r}.stacks: the agent asks before it
        # kills a hung rank.
        self._stacks_file = install_stack_dump(self.run_dir, self.env.rank) if self.run_dir else None
        self.store = connect_worker_store(self.env, timeout=timedelta(seconds=config.join_timeout_s))
        self.slots = LocalSlots(self.store)
        _explain_ddp_before_run(self.store, self.env.rank)

    # --------------------------------------------------------------- public
    def ddp(self, model: torch.nn.Module, **ddp_kwargs: Any) -> ReplicatedModule:
        """``model`` data-parallel: call what this returns as you would a DDP model.

        DDP is built again on every generation's group, with the supervisor's
        fixed-layout reduction as its communication hook (bitwise across
        recoveries, overlapping backward). ``ddp_kwargs`` go to DDP.
        """
        wrapped = ReplicatedModule(model, ddp_kwargs, phase=self._auto_phase)
        self._ddps.append((wrapped, None))
        return wrapped

    def run(self, step_fn: StepFn, state: TrainState, *, on_new_group: Callable[[], None] | None = None) -> TrainState:
        """Runs ``step_fn`` until ``state.step == config.steps``, through faults."""
        if dist.is_initialized():
            raise UsageError("the supervisor builds the process group itself: do not call init_process_group")
        if self.config.reproducible:
            torch.set_num_threads(1)
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        self.state = state
        self.ctx = StepContext(self)
        self._on_new_group = on_new_group
        self._setup_parts(state)
        self.store.set(Keys.supervised(self.env.rank), str(os.getpid()))
        self.events.emit("run_start", rank=self.env.rank, pid=os.getpid(), world_size=self.env.world_size,
                         replacement=self.env.replacement, steps=self.config.steps, since_spawn_s=_since_spawn())
        self._watcher = GenerationWatcher(self.store, rank=self.env.rank, interval_s=self.config.watch_interval_s,
                                          on_moved=self._abort_nccl)
        self._fresh = not self.env.replacement
        self._new_process = True
        self._live: int | None = None if self.env.replacement else state.step
        self._last_exception: tuple[int, str, str] | None = None  # (step, signature, traceback) of the last one
        self._failure: tuple[str, str, Any] | None = None  # (type name, message, Failure) of the last fault
        self._timings: dict[str, float] = {}
        self._without_progress = 0
        self._stopped: JobStopped | None = None
        handlers: dict[SupervisorState, Callable[[], SupervisorState]] = {
            _S.JOINING: self._join, _S.RESTORING: self._restore, _S.TRAINING: lambda: self._train(step_fn),
            _S.FINISHING: self._finish, _S.RECOVERING: self._recover,
        }
        self.lifecycle.to(_S.JOINING)
        try:
            while self.lifecycle.state not in (_S.DONE, _S.FAILED):
                try:
                    nxt = handlers[self.lifecycle.state]()
                except RunFinished:
                    nxt = _S.DONE
                except Exception as exc:  # noqa: BLE001  (every failure goes through the same judgement)
                    nxt = self._judge(exc)
                self.lifecycle.to(nxt)
        finally:
            self._watcher.close()
            for handle in self._hooks:
                handle.remove()
            self._release_group()
            for part, error in self.parts.close():
                self.events.emit("part_close_failed", rank=self.env.rank, part=part, error=error[:500])
                print(f"resilient-train: rank {self.env.rank}: {part} did not close cleanly: {error.splitlines()[0]}",
                      file=sys.stderr, flush=True)
        if self._stopped is not None:
            self.events.emit("run_end", rank=self.env.rank, pid=os.getpid(), step=state.step,
                             recoveries=self.recoveries, stopped=self._stopped.reason)
            raise SystemExit(self._stopped.exit_code)
        self.events.emit("run_end", rank=self.env.rank, pid=os.getpid(), step=state.step, recoveries=self.recoveries)
        return state

    # ---------------------------------------------------------------- parts
    def _setup_parts(self, state: TrainState) -> None:
        c, rank = self.config, self.env.rank
        parts: list[Part] = []
        faults = loads_faults(os.environ.get(envvars.RT_CHAOS, ""))
        chaos = ChaosPart(faults, rank=rank, claim=self._claim_fault, announce=self._announce_fault)
        if chaos:  # before progress: a rank stopped "at" a phase has not entered it
            parts.append(chaos)
        if self.run_dir is not None:
            # Written by the main thread only, at every phase change: the agent's hang detector reads it.
            parts.append(ProgressPart(ProgressReporter(
                self.run_dir, rank, cuda_device=self.device if self.device.type == "cuda" else None)))
        if c.cupti is not None:
            parts.append(CuptiPart(c.cupti, self.events))
        self.disk = (DiskCheckpoints(c.checkpoint, rank=rank, world_size=self.env.world_size, store=self.store,
                                     events=self.events, run_dir=self.run_dir) if c.checkpoint is not None else None)
        if self.disk is not None:
            parts.append(DiskPart(self.disk, self._enter, steps=c.steps))
        self.snapshot: SnapshotPart | None = None
        if c.snapshot_every is not None:
            self.snapshot = SnapshotPart(c.snapshot_every, self._snapshot_local)
            parts.append(self.snapshot)
        self.rerun: RerunPart | None = None
        if c.rerun.enabled:
            hooks = RerunHooks(exchange=self._exchange, rewind=lambda step: self._rewind(step), save=self._save_for_stop,
                               exit=_exit, publish=lambda key, value: self.store.set(key, value))
            self.rerun = RerunPart(c.rerun, rank=rank, world_size=self.env.world_size, emit=self.events.emit,
                                   hooks=hooks, device_index=self.device.index if self.device.type == "cuda" else None)
            state.runtime["rerun"] = self.rerun.driver.stateful()  # in the published local state and checkpoints
            parts.append(self.rerun)
        self.parts = Parts(parts)
        self.gate = CommitGate(world_size=self.env.world_size, group=lambda: self.group, device=self.device,
                               vote=self._vote, moved=lambda: self._watcher.moved.is_set(), decide=self._decide,
                               before_update=self._before_update,
                               on_optimizer=lambda: self._auto_phase(Phase.OPTIMIZER.value))
        self._hooks = [state.optimizer.register_step_pre_hook(self.gate.pre_hook)] if state.optimizer is not None else []
        self._guard = BufferGuard(state.model)
        self._loss = _LossReadout()
        self._reducer: GradientReducer | None = None  # ctx.average_gradients(), made on first use

    def _new_reducer(self, params: Any) -> GradientReducer:
        hooks = ReducerHooks(vote=self._vote, group=lambda: self.group,
                             before_chunk=lambda views, last: self.parts.before_chunk(views, last, self.ctx.step))
        reducer = GradientReducer(list(params), hooks, chunk_mb=self.config.chunk_mb)
        self.gate.reducers.append(reducer)
        return reducer

    # ------------------------------------------------------------ lifecycle
    def _join(self) -> SupervisorState:
        self._enter("startup" if self._fresh else "recovery", self.state.step)
        t0 = time.monotonic()
        if self.store.check([Keys.FINAL]):
            raise RunFinished()

        def me() -> Membership:
            snap = self.snapshot.snapshot.step if self.snapshot is not None else None
            return Membership(rank=self.env.rank, pid=os.getpid(), live_step=self._live, snapshot_step=snap,
                              local_steps=self.slots.steps(self.env.rank), replacement=self.env.replacement,
                              fresh=self._fresh, new_process=self._new_process)

        plan = join_generation(self.store, world_size=self.env.world_size, me=me,
                               timeout=self.config.join_timeout_s, finished=lambda: self.store.check([Keys.FINAL]),
                               stopped=self._raise_if_stopped)
        self.generation = plan.generation
        self._watcher.watch(plan.generation)
        self._enter(Phase.RENDEZVOUS.value, plan.step if plan.step is not None else self.state.step)
        self.group = build_group(self.store, plan.generation, rank=self.env.rank, world_size=self.env.world_size,
                                 backend=self.backend, timeout_s=self.config.pg_timeout_s, device=self.device)
        self.parts.on_generation(plan.generation, self.store)
        self._plan = plan
        self._timings["rendezvous_s"] = time.monotonic() - t0
        return _S.RESTORING

    def _restore(self) -> SupervisorState:
        plan, state = self._plan, self.state
        t0 = time.monotonic()
        if plan.source is ResumeSource.LIVE:
            self._heal(plan)
        else:
            self._load_from_disk(plan)
        self._fresh = self._new_process = False
        self.gate.begin_step()
        self._discard_gradients()
        self._guard.mark()
        self._rebuild_ddp(first=plan.source is ResumeSource.START)
        if self._on_new_group is not None:
            self._on_new_group()
            # A DDP the script builds itself is built here: it gets the fixed-layout hook, and one kept from an
            # earlier generation is a misuse (the search walks the heap: only where it can find something).
            adopt_user_ddp(state.model, self.group, lambda: self._new_reducer(state.model.parameters()),  # type: ignore[arg-type]
                           plan.generation)
        self.parts.on_restored(state)
        self._timings["heal_s"] = time.monotonic() - t0
        self._report_recovery(plan)
        return _S.TRAINING

    def _train(self, step_fn: StepFn) -> SupervisorState:
        state = self.state
        while state.step < self.config.steps:
            self._one_step(step_fn, state.step)
            state.step += 1
            self._live = state.step
            self._without_progress = 0
            self._end_boundary()
            self.parts.on_step_end(state)
            if self.env.rank == 0:
                self.events.emit("step_done", step=state.step, loss=self._loss.value(), generation=self.generation)
            self.ctx.enter(Phase.BETWEEN_STEPS)
        return _S.FINISHING

    def _finish(self) -> SupervisorState:
        self._enter("checkpoint", self.state.step)  # waiting for every rank, then for the final state
        finish_run(
            self.store, generation=self.generation, rank=self.env.rank, world_size=self.env.world_size,
            moved=self._watcher.moved, timeout=self.config.join_timeout_s,
            write_final=self._write_final if self.config.write_final and self.run_dir is not None else None,
        )
        return _S.DONE

    # ----------------------------------------------------------------- step
    def _one_step(self, step_fn: StepFn, step: int) -> None:
        """One step, committed (or skipped by the rerun policy); re-run flows happen before the commit."""
        mode = ComputeMode.COMMIT
        while True:
            try:
                self._compute(step_fn, step, self.env.rank, mode)
                return
            except StepRejected as rejected:
                assert self.rerun is not None, "a rejected step without the rerun machine"
                self._rewind(step)
                outcome = self.rerun.resolve(rejected, step, lambda as_rank: self._measure(step_fn, step, as_rank))
                self._rewind(step)
                if outcome is Outcome.SKIP:
                    self._publish_local(step + 1)  # the batch is skipped: the boundary's state carries over
                    return
                mode = ComputeMode.ACCEPT

    def _compute(self, step_fn: StepFn, step: int, as_rank: int, mode: ComputeMode) -> Any:
        self.ctx.step, self.ctx.data_rank = step, as_rank
        self._mode = mode
        if self.rerun is not None:
            self.rerun.begin(mode)
        self.gate.begin_step()
        self.ctx.phase = Phase.BETWEEN_STEPS
        self._auto_phase(Phase.DATA.value)
        out = step_fn(self.ctx)
        self.gate.commit()  # the optimizer never stepped (or there is none): the step still needs its vote
        self.ctx.data_rank = self.env.rank
        self._loss.note(out)
        return out

    def _measure(self, step_fn: StepFn, step: int, as_rank: int) -> Any:
        """Computes ``step`` as ``as_rank`` up to its commit (a re-run); returns its result."""
        from resilient_train.commit import StepMeasured

        self._rewind(step, as_rank)
        try:
            self._compute(step_fn, step, as_rank, ComputeMode.MEASURE)
        except StepMeasured:
            pass
        finally:
            self.ctx.data_rank = self.env.rank
        assert self.rerun is not None
        return self.rerun.result()

    def _vote(self) -> float:
        """This rank's vote on the step, cast just before it goes out in the reduction."""
        self._auto_phase(Phase.ALL_REDUCE.value)
        if self._watcher.moved.is_set():
            return 0.0  # abstain: the generation is over, nobody may commit
        vote = self.rerun.vote() if self.rerun is not None else 1.0
        if self._mode is not ComputeMode.MEASURE and not math.isnan(vote):
            self._publish_local(self.ctx.step + 1)
        return vote

    def _decide(self, total: float) -> None:
        if self.rerun is not None:
            self.rerun.at_gate(self.ctx.step, total)
        elif math.isnan(total):
            raise GenerationFailed("the commit vote came back NaN (a collective aborted mid-way)")

    def _before_update(self) -> None:
        self._live = None  # from here until the step ends, the state is between two boundaries
        self.parts.before_update()

    def _publish_local(self, step: int) -> None:
        sd = self.state.local_state_dict()
        sd["step"] = step
        payload = encode_local(sd)
        self.slots.publish(self.env.rank, step, payload)
        self._published = (step, sd)

    def _end_boundary(self) -> None:
        """The step ended: what was published at its vote must be the boundary's local state."""
        step, sd = self._published
        now = self.state.local_state_dict()
        if step != self.state.step or not _same(now, sd):
            self._publish_local(self.state.step)
            if not getattr(self, "_warned_late_local", False):
                self._warned_late_local = True
                self.events.emit("local_state_changed_after_reduction", rank=self.env.rank, step=self.state.step)
        self._guard.mark()

    def _rewind(self, step: int, as_rank: int | None = None) -> None:
        """Back to boundary ``step`` before its commit: gradients dropped, ``as_rank``'s local state loaded."""
        self._discard_gradients()
        self._guard.restore()
        sd = self.slots.read_decoded(self.env.rank if as_rank is None else as_rank, step)
        if as_rank is not None and as_rank != self.env.rank:
            sd = _adopt_peer_local(sd, self.device)
        self.state.load_local(sd)

    def _discard_gradients(self) -> None:
        for p in self.state.model.parameters():
            p.grad = None

    # ------------------------------------------------------------- restore
    def _heal(self, plan: ResumePlan) -> None:
        state, rank, step = self.state, self.env.rank, plan.step
        assert step is not None
        self._enter(Phase.HEAL.value, step)
        if rank in plan.from_snapshot:
            assert self.snapshot is not None
            state.load_replicated(self.snapshot.snapshot.replicated())
        sent = received = 0
        for target, source in sorted(plan.heal_from.items()):
            if source == rank:
                sent += send_state(state.replicated_state_dict(), target, device=self._comm_device)
        if rank in plan.heal_from:
            self._live = None  # torn until the whole state arrived
            healed, received = receive_state(plan.heal_from[rank], device=self._comm_device)
            state.load_replicated(healed)
        state.load_local(self.slots.read_decoded(rank, step))
        if self.rerun is not None and plan.members[rank].replacement:
            self.rerun.adopt_newest_record(self.store)
        assert state.step == step, (state.step, step)
        self._live = step
        self._published = (step, self.state.local_state_dict())
        if sent or received:
            self.events.emit("healed", rank=rank, step=step, generation=plan.generation, bytes_sent=sent,
                             bytes_received=received, from_rank=plan.heal_from.get(rank))

    def _load_from_disk(self, plan: ResumePlan) -> None:
        state = self.state
        loaded = None
        if self.disk is not None:
            self._enter("load", state.step)
            self._live = None
            loaded = self.disk.load_agreed(state, self.store, plan.generation, timeout=self.config.join_timeout_s)
        if loaded is None and plan.source is ResumeSource.DISK:
            raise JoinError("no live replica holds a recoverable step and there is no checkpoint to fall back on")
        if loaded is not None:
            self.events.emit("resumed_from_disk", rank=self.env.rank, step=loaded, generation=plan.generation)
            if self.env.rank == 0:
                print(f"resilient-train: resumed from the checkpoint of step {loaded}", file=sys.stderr, flush=True)
        self._live = state.step
        self._publish_local(state.step)

    def _release_group(self) -> None:
        """Drops every reference to the failed group, then destroys it.

        A gloo group closes its connections only when its last reference goes:
        while a DDP, a pending reduction or a frame holds it, peers blocked in a
        collective with this rank wait for the full group timeout instead of
        failing at once.
        """
        for reducer in self.gate.reducers:
            reducer.reset()
        for wrapped, _ in self._ddps:
            wrapped.drop()
        self.group = None
        destroy_group(self.device)
        gc.collect()

    def _rebuild_ddp(self, *, first: bool) -> None:
        for i, (wrapped, reducer) in enumerate(self._ddps):
            if reducer is None:
                reducer = self._new_reducer(wrapped.module.parameters())
                self._ddps[i] = (wrapped, reducer)
            assert self.group is not None
            wrapped.rebuild(self.group, reducer, first=first)

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------ failures
    def _judge(self, exc: BaseException) -> SupervisorState:
        """A failure: recover it, or stop the job (a bug, a misuse, no progress)."""
        stop = read_stop(self.store) if not isinstance(exc, JobStopped) else None
        if isinstance(exc, JobStopped) or (stop is not None and stop.get("rank") != self.env.rank):
            self._stopped = exc if isinstance(exc, JobStopped) else JobStopped(stop["summary"], int(stop["exit_code"]))
            return _S.FAILED
        if isinstance(exc, JoinError):
            return self._stop_job(str(exc), exc, exit_code=exitcodes.FAILED)
        if is_disk_full(exc):  # every replacement would fail the same write
            return self._stop_job(str(exc), None, exit_code=exitcodes.DISK_FULL)
        failure = classify(exc)
        step = self.ctx.step
        if failure.kind is FailureKind.USAGE:
            return self._stop_job(str(exc), exc)
        if failure.kind is FailureKind.EXCEPTION and not self._watcher.moved.is_set():
            last = self._last_exception
            if last is not None and last[0] == step and last[1] == failure.signature:
                return self._stop_job(f"{failure.summary} (raised again when step {step} was replayed)", exc,
                                      first_traceback=last[2])
            self._last_exception = (step, failure.signature, "".join(traceback.format_exception(exc)))
        # Only text: the exception's frames hold tensors and the failed group's work, which must be freed.
        self._failure = (type(exc).__name__, str(exc), failure)
        return _S.RECOVERING

    def _stop_job(self, reason: str, exc: BaseException | None, *, first_traceback: str | None = None,
                  exit_code: int = exitcodes.STOPPED) -> SupervisorState:
        """Stops the whole job; the original traceback (if any) and the reason are printed once."""
        stood = request_stop(self.store, {"rank": self.env.rank, "summary": reason, "exit_code": exit_code,
                                          "step": self.ctx.step, "generation": self.generation})
        if stood.get("rank") == self.env.rank and stood.get("summary") == reason:
            text = first_traceback or ("".join(traceback.format_exception(exc)) if exc is not None else "")
            if exc is not None and not isinstance(exc, UsageError):
                sys.stderr.write(text)
            if not self.env.under_agent:  # the agent says it once for the job
                print(f"resilient-train: rank {self.env.rank} stopped the job: {reason}", file=sys.stderr, flush=True)
            self.events.emit("job_stopped", rank=self.env.rank, reason=reason, exit_code=exit_code, step=self.ctx.step,
                             generation=self.generation, traceback=text[-4000:])
        self._stopped = JobStopped(stood.get("summary", reason), int(stood.get("exit_code", exit_code)))
        return _S.FAILED

    def _raise_if_stopped(self) -> None:
        stop = read_stop(self.store)
        if stop is not None:
            raise JobStopped(stop["summary"], int(stop["exit_code"]))

    def _recover(self) -> SupervisorState:
        assert self._failure is not None
        kind, message, failure = self._failure
        self._enter("recovery", self.ctx.step)
        t_detect = time.time()
        g = self.generation
        first = False
        if g >= 0:
            first = declare_fault(self.store, g, {"rank": self.env.rank, "kind": kind, "time": t_detect,
                                                  "step": self.ctx.step, "phase": self.ctx.phase.value,
                                                  **failure.to_dict()})
        cause = read_fault(self.store, g) if g >= 0 else None
        self.recoveries += 1
        self._without_progress += 1
        self.events.emit("fault_detected", rank=self.env.rank, generation=g, step=self.ctx.step,
                         phase=self.ctx.phase.value, kind=kind, error=message[:300],
                         failure=failure.kind.value, first_reporter=first, cause=cause)
        t0 = time.monotonic()
        self._release_group()
        self._discard_gradients()
        if self._live is not None:
            self._guard.restore()  # a fault before the commit: forward may have changed buffers
        if self.recoveries > self.config.max_recoveries:
            return self._stop_job(f"gave up after {self.config.max_recoveries} recoveries (last: {failure.summary})",
                                  None, exit_code=exitcodes.FAILED)
        if self._without_progress > self.config.max_failed_generations:
            return self._stop_job(f"{self._without_progress} generations in a row failed without completing a step "
                                  f"(last: {failure.summary})", None)
        fault_time = float(cause["time"]) if cause and "time" in cause else t_detect
        self._timings = {"detect_s": max(0.0, t_detect - fault_time), "abort_s": time.monotonic() - t0,
                         "fault_step": float(self.ctx.step)}
        return _S.JOINING

    def _report_recovery(self, plan: ResumePlan) -> None:
        if "detect_s" not in self._timings:
            return  # a fresh start, not a recovery
        t = self._timings
        self.events.emit(
            "recovery_done", rank=self.env.rank, generation=plan.generation, resume_step=plan.step,
            resume_from=plan.source.value, replacements=plan.replacements, healed=plan.healed, detect_s=t["detect_s"],
            abort_s=t["abort_s"], rendezvous_s=t["rendezvous_s"], heal_s=t["heal_s"],
            steps_redone=max(0, int(t["fault_step"]) - (plan.step or 0)),
        )
        self._timings = {}

    # ---------------------------------------------------------- entry points
    def _auto_phase(self, phase: str) -> None:
        """A phase the runtime sees by itself (DDP's forward and backward, the reduction, the commit).

        Only forward moves: a script that marks its phases with ``ctx.enter`` is not overridden.
        """
        order = _PHASE_ORDER
        if self.lifecycle.state is _S.TRAINING and order.get(phase, 0) > order.get(self.ctx.phase.value, 0):
            self.ctx.enter(phase)

    def _enter(self, phase: str, step: int) -> None:
        if self._watcher.moved.is_set() and phase in _STEP_PHASES:
            raise GenerationFailed(f"generation {self.generation} was declared failed")
        self.parts.on_phase(phase, step)

    def _reduce_gradients(self) -> None:
        if self._reducer is None:
            self._reducer = self._new_reducer(self.state.model.parameters())
        self._reducer.reduce_all()

    def _on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.parts.on_loss(loss, self.ctx.step, self.ctx.data_rank)

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

    def _write_final(self) -> None:
        from checkpointing import write_state

        steps = self.config.steps
        locals_ = published_local_states(self.store, world_size=self.env.world_size, step=steps)
        for local in locals_.values():
            local.pop("rerun", None)  # the run's memory of faults, not training state
        path = self.run_dir / "final"  # type: ignore[operator]
        write_state(path, self.state.state_dict(local_states=locals_), step=steps,
                    extras={"world_size": self.env.world_size})
        self.events.emit("final_state_written", path=str(path), step=steps)

    def _claim_fault(self, index: int) -> bool:
        """True once per fault and run, across replacements and launcher restarts."""
        if self.run_dir is None:
            return self.store.add(Keys.chaos_fired(index), 1) == 1
        marker = self.run_dir / ".chaos" / f"fired-{index}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _announce_fault(self, fault: Fault) -> None:
        self.events.emit("fault_injected", rank=self.env.rank, pid=os.getpid(), kind=fault.kind.value,
                         phase=fault.phase.value, step=self.ctx.step)


_STEP_PHASES = frozenset(p.value for p in Phase if p not in RECOVERY_PHASES)
_PHASE_ORDER = {p.value: i for i, p in enumerate(
    [Phase.BETWEEN_STEPS, Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.ALL_REDUCE, Phase.OPTIMIZER])}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _adopt_peer_local(sd: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A peer's local state, to compute as that peer: its CUDA RNG stream becomes this device's."""
    theirs = sd.pop("rerun", {}).get("device")  # the machine is mid-flow: its own state stays
    cuda = sd.get("rng", {}).get("cuda")
    if cuda is not None and theirs is not None and device.type == "cuda" and theirs != device.index:
        cuda = list(cuda)
        cuda[device.index] = cuda[theirs]
        sd["rng"]["cuda"] = cuda
    return sd


class _LossReadout:
    """The step's loss for the ``step_done`` event, read without making the host wait for the device.

    A ``loss.item()`` per step would sync the host with the GPU (and, with a
    host snapshot in flight, queue behind its copy); a CUDA loss is copied to
    pinned memory instead and reported once the copy has landed (else left out).
    """

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._ready: Any = None
        self._value: float | None = None

    def note(self, out: Any) -> None:
        self._value, self._ready = None, None
        if isinstance(out, torch.Tensor) and out.numel() == 1:
            if out.is_cuda:
                if self._host is None:
                    self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
                self._host.copy_(out.detach().float().reshape(()), non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record()
            else:
                self._value = float(out.detach().float())
        elif isinstance(out, (int, float)):
            self._value = float(out)

    def value(self) -> float | None:
        if self._ready is not None and self._ready.query():
            self._value, self._ready = float(self._host), None  # type: ignore[arg-type]
        return self._value


def _exit(code: int) -> Any:
    raise SystemExit(code)


def _since_spawn() -> float | None:
    """Seconds from the agent starting this worker to its run starting (None without an agent)."""
    spawned = os.environ.get(envvars.RT_SPAWNED_AT)
    return round(time.time() - float(spawned), 3) if spawned else None


def _explain_ddp_before_run(store: dist.Store, rank: int) -> None:
    """A DDP built before ``sup.run`` fails deep in torch; say in one line (once per job) what to do instead."""
    previous = sys.excepthook

    def hook(kind: type, exc: BaseException, tb: Any) -> None:
        if isinstance(exc, (ValueError, RuntimeError)) and "process group has not been initialized" in str(exc):
            torch_dir = os.path.dirname(torch.__file__)
            frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(torch_dir)]
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            reason = (f"a process group was used before sup.run built one{where}: wrap the model with "
                      "sup.ddp(model), or build DDP in on_new_group")
            try:
                first = request_stop(store, {"rank": rank, "summary": reason, "exit_code": exitcodes.STOPPED})
            except Exception:  # noqa: BLE001  (no store: say it anyway)
                first = {"rank": rank}
            if first.get("rank") == rank and os.environ.get(envvars.RT_AGENT) != "1":  # else the agent says it
                print(f"resilient-train: error: {reason}", file=sys.stderr, flush=True)
            os._exit(exitcodes.STOPPED)
        previous(kind, exc, tb)

    sys.excepthook = hook
