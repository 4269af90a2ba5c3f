"""The supervisor: runs a training loop inside a rank and keeps it alive.

A user hands it a step function and a :class:`TrainState`; it builds the
process group of each generation, snapshots the state at every step boundary,
and on any fault (an exception in the step, a dead peer surfacing as a
collective error, another party declaring the generation failed) it aborts the
process group, rolls back, joins the next generation, heals replacement ranks
from a peer and carries on. See shared/DESIGN.md, "Recovery protocol".
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from chaos import Fault, Injector, Phase, loads_faults
from chaos.values import ValueFaults
from checkpointing import CheckpointConfig
from monitors import EventLog, ProgressReporter
from monitors.cupti_kernels import CuptiConfig, CuptiKernelScores
from monitors.stacks import install_stack_dump
from resilient_train import env as envvars
from resilient_train.dataparallel import GradientAverager
from resilient_train.disk import DiskCheckpoints
from resilient_train.finish import finish_run, published_local_states
from resilient_train.generation import (
    GenerationFailed, JoinError, Membership, ResumePlan, ResumeSource, RunFinished, join_generation,
)
from resilient_train.heal import broadcast_state
from resilient_train.lifecycle import Lifecycle, SupervisorState
from resilient_train.rerun import RerunConfig
from resilient_train.rerun.support import RerunSupport
from resilient_train.snapshot import SnapshotRing
from resilient_train.store import Keys, connect_worker_store, declare_fault, read_fault
from resilient_train.train_state import TrainState, as_float, decode_local, encode_local
from resilient_train.watch import GenerationWatcher

__all__ = ["GenerationFailed", "RunFinished", "StepContext", "Supervisor", "SupervisorConfig"]


@dataclass(kw_only=True)
class SupervisorConfig:
    steps: int
    backend: str = "auto"  # "gloo", "nccl", or "auto" (nccl when CUDA is available)
    pg_timeout_s: float = 30.0  # gloo cannot be aborted: this bounds a collective stuck on a silent peer
    join_timeout_s: float = 120.0
    max_recoveries: int = 32
    intra_op_threads: int | None = 1  # a fixed count keeps CPU results reproducible; None leaves torch's
    deterministic: bool = True
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


class StepContext:
    """What a step function sees: its rank, the step, and the named phases."""

    def __init__(self, sup: "Supervisor") -> None:
        self._sup = sup
        self.rank = sup.env.rank
        self.world_size = sup.env.world_size
        self.device = sup.device
        self.step = 0
        self.phase: Phase = Phase.BETWEEN_STEPS
        # Whose batch this computation is: another rank's when a peer re-runs it (data = f(seed, step, data_rank)).
        self.data_rank = self.rank

    @property
    def generation(self) -> int:
        return self._sup.generation

    def enter(self, phase: Phase | str) -> None:
        """Marks the start of a phase: faults are noticed and injected here."""
        self.phase = Phase(phase)
        self._sup._checkpoint_phase(self.phase, self.step)

    def average_gradients(self) -> None:
        """The data-parallel gradient all-reduce, as its own phase."""
        self.enter(Phase.ALL_REDUCE)
        self._sup._reduce_gradients()

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Reports the step's loss before ``backward``; use the tensor it returns (value faults apply here)."""
        return self._sup._on_loss(loss)


StepFn = Callable[[StepContext], Any]


class Supervisor(RerunSupport):
    def __init__(self, config: SupervisorConfig, *, env: envvars.WorkerEnv | None = None) -> None:
        self.config = config
        self.env = env or envvars.WorkerEnv.from_environ()
        if config.deterministic:
            # cuBLAS is deterministic only with a fixed workspace, set before its first use.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.lifecycle = Lifecycle()
        self.generation = -1
        self.recoveries = 0
        self.device = self._pick_device()
        run_dir = self.env.run_dir
        self.run_dir = Path(run_dir) if run_dir else None
        self.events = EventLog(self.run_dir / "events.jsonl" if self.run_dir else None, source=f"rank{self.env.rank}")
        # Written by the main thread only, at every phase change: the agent's hang detector reads it.
        # On a GPU it also times each section on the device with CUDA events (straggler scores use them).
        self.progress = (
            ProgressReporter(self.run_dir, self.env.rank,
                             cuda_device=self.device if self.device.type == "cuda" else None)
            if self.run_dir else None
        )
        # On SIGUSR1 every thread's stack goes to RUN_DIR/.monitors/rank{r}.stacks: the agent asks before it
        # kills a hung rank.
        self._stacks_file = install_stack_dump(self.run_dir, self.env.rank) if self.run_dir else None
        self.store = connect_worker_store(self.env, timeout=timedelta(seconds=config.join_timeout_s))
        self._ring = SnapshotRing(2)
        self._watcher: GenerationWatcher | None = None
        faults = loads_faults(os.environ.get(envvars.RT_CHAOS, ""))
        # Phase faults fire at phase boundaries; value faults change the loss or gradients.
        self._injector = Injector(faults, rank=self.env.rank, claim=self._claim_fault, announce=self._announce_fault)
        self._values = ValueFaults(faults, rank=self.env.rank, claim=self._claim_fault, announce=self._announce_fault)
        self._averager: GradientAverager
        self._timings: dict[str, float] = {}
        self._measured: list[torch.Tensor | None] = [None, None]  # this computation's loss, local grad norm
        self._rerun = self._make_rerun() if config.rerun.enabled else None
        self._cupti = CuptiKernelScores(config.cupti) if config.cupti is not None else None

    # ----------------------------------------------------------------- setup
    def _pick_device(self) -> torch.device:
        backend = self._backend()
        if backend == "nccl":
            torch.cuda.set_device(self.env.local_rank)
            return torch.device("cuda", self.env.local_rank)
        return torch.device("cpu")

    def _backend(self) -> str:
        if self.config.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.config.backend

    # -------------------------------------------------------------- the run
    def run(self, step_fn: StepFn, state: TrainState, *, on_new_group: Callable[[], None] | None = None) -> TrainState:
        """Runs ``step_fn`` until ``state.step == config.steps``, through faults."""
        if dist.is_initialized():
            raise ValueError("the supervisor builds the process group itself: do not call init_process_group")
        if self.config.intra_op_threads is not None:
            torch.set_num_threads(self.config.intra_op_threads)
        if self.config.deterministic:
            torch.use_deterministic_algorithms(True)
        self.state = state
        if self._rerun is not None:
            state.runtime["rerun"] = self._rerun.stateful()  # in snapshots, published local state, checkpoints
        self._averager = GradientAverager(state.model.parameters())
        self.ctx = StepContext(self)
        self.store.set(Keys.supervised(self.env.rank), str(os.getpid()))
        self.events.emit(
            "run_start", rank=self.env.rank, pid=os.getpid(), world_size=self.env.world_size,
            replacement=self.env.replacement, steps=self.config.steps, since_spawn_s=_since_spawn(),
        )
        self.disk = (
            DiskCheckpoints(self.config.checkpoint, rank=self.env.rank, world_size=self.env.world_size,
                            store=self.store, events=self.events, run_dir=self.run_dir)
            if self.config.checkpoint is not None else None
        )
        self._watcher = GenerationWatcher(
            self.store, rank=self.env.rank, interval_s=self.config.watch_interval_s, on_moved=self._abort_nccl
        )
        fresh = not self.env.replacement
        try:
            while True:
                try:
                    self._generation_round(step_fn, fresh, on_new_group)
                    break
                except RunFinished:
                    self.lifecycle.to(SupervisorState.DONE)
                    break
                except (KeyboardInterrupt, SystemExit, JoinError):
                    self.lifecycle.to(SupervisorState.FAILED)
                    raise
                except Exception as exc:  # any fault: the protocol is the same
                    fresh = False
                    self._recover_from(exc)
        finally:
            if self._watcher is not None:
                self._watcher.close()
            self._destroy_group()
            if self.progress is not None:
                self.progress.close()
            if self._cupti is not None:
                self._cupti.close()
            if self.disk is not None:
                self.disk.close()
        if self._rerun is not None:
            self.events.emit("rerun_summary", rank=self.env.rank, **self._rerun.summary())
        self.events.emit("run_end", rank=self.env.rank, pid=os.getpid(), step=state.step, recoveries=self.recoveries)
        return state

    def _generation_round(self, step_fn: StepFn, fresh: bool, on_new_group: Callable[[], None] | None) -> None:
        self.lifecycle.to(SupervisorState.JOINING)
        self._progress("startup" if fresh else "recovery", self.state.step)
        t0 = time.monotonic()
        me = Membership(
            rank=self.env.rank,
            pid=os.getpid(),
            snapshot_steps=self._ring.steps(),
            local_steps=self._published_local_steps() if not self._ring.steps() else [],
            replacement=self.env.replacement,
            fresh=fresh,
        )
        plan = self._join(me)
        self.generation = plan.generation
        self._watcher.watch(plan.generation)  # type: ignore[union-attr]
        self._init_group(plan.generation)
        if self._cupti is not None:
            self._cupti.on_new_generation()
        if self.disk is not None:
            self.disk.on_generation(self.store, plan.generation)
        self._timings["rendezvous_s"] = time.monotonic() - t0
        self.lifecycle.to(SupervisorState.RESTORING)
        t1 = time.monotonic()
        self._restore(plan)
        self._timings["heal_s"] = time.monotonic() - t1
        if self.disk is not None:
            self.disk.prepare(self.state)
        if on_new_group is not None:
            on_new_group()
        self._report_recovery(plan)
        self.lifecycle.to(SupervisorState.TRAINING)
        self._train(step_fn)
        self.lifecycle.to(SupervisorState.FINISHING)
        self._finish()
        self.lifecycle.to(SupervisorState.DONE)

    def _join(self, me: Membership) -> ResumePlan:
        if self.store.check([Keys.FINAL]):
            raise RunFinished()
        return join_generation(
            self.store, world_size=self.env.world_size, me=me, timeout=self.config.join_timeout_s,
            finished=lambda: self.store.check([Keys.FINAL]),
        )

    def _init_group(self, g: int) -> None:
        prefix = dist.PrefixStore(Keys.pg_prefix(g), self.store)
        kwargs: dict[str, Any] = {}
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device
        dist.init_process_group(
            self._backend(), store=prefix, rank=self.env.rank, world_size=self.env.world_size,
            timeout=timedelta(seconds=self.config.pg_timeout_s), **kwargs,
        )

    def _destroy_group(self) -> None:
        if not dist.is_initialized():
            return
        try:
            if self.device.type == "cuda":
                dist.distributed_c10d._abort_process_group()
            dist.destroy_process_group()
        except Exception:  # a broken group: nothing left to release
            pass

    # -------------------------------------------------------------- restore
    def _restore(self, plan: ResumePlan) -> None:
        state = self.state
        if plan.source in (ResumeSource.START, ResumeSource.DISK):
            loaded = None
            if self.disk is not None:
                self._progress("load", state.step)
                loaded = self.disk.load_agreed(state, self.store, plan.generation, timeout=self.config.join_timeout_s)
            if loaded is None and plan.source is ResumeSource.DISK:
                raise JoinError("no step is held by every rank and there is no checkpoint to fall back on")
            if loaded is not None:
                self.events.emit("resumed_from_disk", rank=self.env.rank, step=loaded, generation=plan.generation)
            self._ring.drop_after(-1)
            self._snapshot()
            return
        assert plan.step is not None and plan.heal_from is not None
        mine = self._ring.steps()
        if mine:
            snap = self._ring.get(plan.step)
            replicated = snap.replicated()
            local = snap.local
        else:
            replicated = None
            local = self._read_published_local(plan.step)
        self._checkpoint_phase(Phase.HEAL, plan.step)
        if plan.replacements:
            healed = broadcast_state(replicated, src=plan.heal_from, device=self.device)
            if replicated is None:
                replicated = healed
        state.load_replicated(replicated)
        decoded = decode_local(local)
        state.load_local(decoded)
        self._load_rerun(decoded, replacement=not mine)
        assert state.step == plan.step, (state.step, plan.step)
        self._ring.drop_after(plan.step)
        self._snapshot()

    # ---------------------------------------------------------------- train
    def _train(self, step_fn: StepFn) -> None:
        state, ctx = self.state, self.ctx
        while state.step < self.config.steps:
            ctx.step = state.step
            out = self._compute(step_fn, state.step, self.env.rank)
            # Settling, validating and snapshotting are the runtime's work, not the optimizer's.
            self._progress(Phase.BETWEEN_STEPS.value, ctx.step)
            self._settle_step()
            if self._rerun is not None:
                self._after_step(step_fn, out)  # may re-run the step, roll it back (skip), or stop
            state.step += 1
            self._snapshot()
            if self._cupti is not None and self._cupti.due(state.step):
                self._kernel_report(state.step)
            if self.disk is not None:
                self._progress("checkpoint", ctx.step)  # still step ctx.step's time: its save
                self.disk.maybe_save(state)
            if self.env.rank == 0:
                self.events.emit("step_done", step=state.step, loss=as_float(out), generation=self.generation)
            ctx.enter(Phase.BETWEEN_STEPS)

    def _settle_step(self) -> None:
        """Makes sure the step really completed before it becomes a snapshot.

        CUDA work is asynchronous: without this, a rank whose all-reduce is
        stuck on a dead peer would run ahead and snapshot steps computed from
        an aborted collective. After the stream drains, a generation declared
        failed meanwhile means the step's result cannot be trusted (the watcher
        marks the generation before it aborts NCCL).
        """
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            if self._generation_moved.is_set():
                raise GenerationFailed(f"generation {self.generation} failed while step {self.ctx.step} ran")

    def _snapshot(self) -> None:
        state = self.state
        local = encode_local(state.local_state_dict())
        self._ring.capture(state.step, state.replicated_state_dict(), local)
        self.store.set(Keys.local_state(self.env.rank, state.step % 2), f"{state.step}\n".encode() + local)

    def _published_local_steps(self) -> list[int]:
        steps = []
        for slot in (0, 1):
            key = Keys.local_state(self.env.rank, slot)
            if self.store.check([key]):
                steps.append(int(self.store.get(key).split(b"\n", 1)[0]))
        return sorted(steps)

    def _read_published_local(self, step: int) -> bytes:
        head, payload = self.store.get(Keys.local_state(self.env.rank, step % 2)).split(b"\n", 1)
        assert int(head) == step, (int(head), step)
        return payload

    def _checkpoint_phase(self, phase: Phase, step: int) -> None:
        if self._generation_moved.is_set():
            raise GenerationFailed(f"generation {self.generation} was declared failed")
        if self._injector:
            self._injector.at(phase, step)
        # After the injector: a rank stopped "at" a phase has not entered it.
        self._progress("recovery" if phase is Phase.HEAL else phase.value, step)

    def _progress(self, section: str, step: int) -> None:
        if self.progress is not None:
            self.progress.enter(section, step)
        if self._cupti is not None:
            self._cupti.enter(section)

    def _kernel_report(self, step: int) -> None:
        report = self._cupti.report(step)  # type: ignore[union-attr]  # collective: every rank, same step
        if report is not None:
            self.events.emit("kernel_straggler_report", source="nvrx-cupti", **report)

    # --------------------------------------------------------------- finish
    def _finish(self) -> None:
        self._progress("checkpoint", self.state.step)  # waiting for every rank, then the final state
        finish_run(
            self.store, generation=self.generation, rank=self.env.rank, world_size=self.env.world_size,
            moved=self._generation_moved, timeout=self.config.join_timeout_s,
            write_final=self._write_final if self.config.write_final and self.run_dir is not None else None,
        )

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

    # ------------------------------------------------------------- recovery
    def _recover_from(self, exc: BaseException) -> None:
        self.lifecycle.to(SupervisorState.RECOVERING)
        self._progress("recovery", self.ctx.step)
        t_detect = time.time()
        g = self.generation
        kind = type(exc).__name__
        first = False
        if g >= 0:
            first = declare_fault(self.store, g, {"rank": self.env.rank, "kind": kind, "time": t_detect,
                                                  "step": self.ctx.step, "phase": self.ctx.phase.value})
        cause = read_fault(self.store, g) if g >= 0 else None
        self.recoveries += 1
        self.events.emit(
            "fault_detected", rank=self.env.rank, generation=g, step=self.ctx.step, phase=self.ctx.phase.value,
            kind=kind, error=str(exc)[:300], first_reporter=first, cause=cause,
        )
        if self.recoveries > self.config.max_recoveries:
            raise RuntimeError(f"gave up after {self.config.max_recoveries} recoveries") from exc
        t0 = time.monotonic()
        self._destroy_group()
        fault_time = float(cause["time"]) if cause and "time" in cause else t_detect
        self._timings = {
            "detect_s": max(0.0, t_detect - fault_time),
            "abort_s": time.monotonic() - t0,
            "fault_step": float(self.ctx.step),
        }

    def _report_recovery(self, plan: ResumePlan) -> None:
        if "detect_s" not in self._timings:
            return  # a fresh start, not a recovery
        t = self._timings
        self.events.emit(
            "recovery_done", rank=self.env.rank, generation=plan.generation, resume_step=plan.step,
            replacements=plan.replacements, detect_s=t["detect_s"], abort_s=t["abort_s"],
            rendezvous_s=t["rendezvous_s"], heal_s=t["heal_s"],
            steps_redone=max(0, int(t["fault_step"]) - (plan.step or 0)),
        )
        self._timings = {}

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
        self.events.emit(
            "fault_injected", rank=self.env.rank, pid=os.getpid(), kind=fault.kind.value, phase=fault.phase.value,
            step=self.ctx.step,
        )

    # ---------------------------------------------------------------- watch
    @property
    def _generation_moved(self) -> threading.Event:
        assert self._watcher is not None
        return self._watcher.moved

    def _abort_nccl(self) -> None:
        # NCCL can be aborted from another thread; gloo cannot, and relies on
        # the dead peer's closed sockets.
        if self.device.type == "cuda" and dist.is_initialized():
            dist.distributed_c10d._abort_process_group()


def _since_spawn() -> float | None:
    """Seconds from the agent starting this worker to its run starting (None without an agent)."""
    spawned = os.environ.get(envvars.RT_SPAWNED_AT)
    return round(time.time() - float(spawned), 3) if spawned else None
