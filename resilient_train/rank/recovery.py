"""A recovery as one rank sees it: the verdict on a failure, the fault reported, the generation left, the report.

The supervisor's loop asks :class:`Recovery` three things: whether a failure
is recovered (:meth:`Recovery.judge`, with :class:`resilient_train.rank.judge.Judge`'s
verdict), to leave the failed generation (:meth:`Recovery.leave`: the fault
reported, ``fault_detected`` said, the rank's hold on the group released), and,
once the next generation restored the state, to say how long the way back took
(:meth:`Recovery.report`, the ``recovery_done`` event). A rank woken by the
watcher asks the store nothing when it leaves: its ``fault_detected`` waits for
its next join, which tells whether the wake was a fault's or a stop's.
"""

from __future__ import annotations

import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist

from checkpointing.errors import storage_error_for
from monitors.events import EventLog
from resilient_train.base import exitcodes
from resilient_train.protocol.env import WorkerEnv
from resilient_train.rank.errors import Failure, JobStopped
from resilient_train.rank.generation import ResumePlan
from resilient_train.rank.judge import Judge, Stop
from resilient_train.rank.rendezvous import leave_generation, stop_after_failure
from resilient_train.protocol.store import Keys, interrupt_for_stop, read_fault, read_stop, request_stop
from resilient_train.rank.watch import GenerationWatcher

__all__ = ["Recovery", "stop_on_storage_fault"]


class Recovery:
    def __init__(self, *, store: dist.Store, events: EventLog, judge: Judge, watcher: GenerationWatcher, rank: int,
                 world_size: int, pg_timeout_s: float, under_agent: bool) -> None:
        self._store, self._events, self._judge, self._watcher = store, events, judge, watcher
        self._rank, self._world_size = rank, world_size
        self._pg_timeout_s, self._under_agent = pg_timeout_s, under_agent
        self.failure: tuple[str, str, Failure] | None = None  # (type name, message, Failure) of the last fault
        self.timings: dict[str, float] = {}
        self.moved_to: int | None = None  # the generation to join after a wake (joined without asking)
        self._woken_detection: dict[str, Any] | None = None  # its fault_detected, said once the join tells
        self._preemption_stopped = False  # stop_for_preemption asked the job's stop

    def judge(self, exc: BaseException, *, step: int) -> JobStopped | Stop | None:
        """A failure: None to recover it; the job's stop (``JobStopped``: another rank's, or ``exc``), or a
        :class:`Stop` for this rank to make (a bug, a misuse, a full disk, no progress)."""
        self.say_woken_detection(None)
        stop = stop_after_failure(self._store, self._watcher) if not isinstance(exc, JobStopped) else None
        if isinstance(exc, JobStopped) or (stop is not None and stop.get("rank") != self._rank):
            return exc if isinstance(exc, JobStopped) else JobStopped(stop["summary"], int(stop["exit_code"]))
        verdict = self._judge.failure(exc, step=step, generation_moved=self._watcher.moved.is_set())
        # The exception may live on (a reduction's future keeps it): its frames' locals (the step's loss, and
        # through its autograd graph every group a Megatron function saved) must not.
        traceback.clear_frames(exc.__traceback__)
        if isinstance(verdict, Stop):
            return verdict
        # Only text: the exception's frames hold tensors and the failed group's work, which must be freed.
        self.failure = (type(exc).__name__, str(exc), verdict)
        return None

    def stop_job(self, stop: Stop, *, step: int, generation: int) -> JobStopped:
        """Stops the whole job; the original traceback (if any) and the reason are said once.

        Returns the stop that stands (the first rank's to ask, which may be another's).
        """
        rank = self._rank
        stood = request_stop(self._store, {"rank": rank, "summary": stop.reason, "exit_code": stop.exit_code,
                                           "step": step, "generation": generation})
        interrupt_for_stop(self._store, world_size=self._world_size)
        if stood.get("rank") == rank and stood.get("summary") == stop.reason:
            sys.stderr.write(stop.traceback)
            if not self._under_agent:  # the agent says it once for the job
                print(f"resilient-train: rank {rank} stopped the job: {stop.reason}", file=sys.stderr, flush=True)
            self._events.emit("job_stopped", rank=rank, reason=stop.reason, exit_code=stop.exit_code,
                              step=step, generation=generation, traceback=stop.traceback[-4000:])
        return JobStopped(stood.get("summary", stop.reason), int(stood.get("exit_code", stop.exit_code)))

    def stop_for_preemption(self, signal: str | None, *, fresh: bool, step: int, generation: int) -> None:
        """A preemption signal came while this rank waited in a join that no peer finished: there is no step
        boundary to checkpoint at, so the job stops now with REQUEUE (the join then ends with this stop).
        Once per rank: a join that completed anyway leaves the stop to be read at the next one."""
        if self._preemption_stopped:
            return
        self._preemption_stopped = True
        while_ = "it joined the job" if fresh else "it recovered from a failure"
        why = (f"preempted ({signal}) while {while_}, with no step boundary every rank shares to checkpoint at: "
               "started again, the job resumes from its newest committed checkpoint")
        self.stop_job(Stop(reason=why, exit_code=exitcodes.REQUEUE), step=step, generation=generation)

    def raise_if_stopped(self) -> None:
        """Raises the job's stop, if one was asked for (a join looks while it waits)."""
        stop = read_stop(self._store)
        if stop is not None:
            raise JobStopped(stop["summary"], int(stop["exit_code"]))

    def leave(self, *, generation: int, step: int, phase: str, release: Callable[[], None]) -> Stop | None:
        """Reports the last failure and leaves ``generation``; ``release`` drops what the rank held of it.

        A stop when the recovery budget is spent.
        """
        assert self.failure is not None
        kind, message, failure = self.failure
        g = generation
        t_detect = time.time()
        first, cause, self.moved_to = leave_generation(
            self._store, g, {"rank": self._rank, "kind": kind, "time": t_detect, "step": step, "phase": phase,
                             **failure.to_dict()},
            world_size=self._world_size, watcher=self._watcher)
        detection = {"rank": self._rank, "generation": g, "step": step, "phase": phase,
                     "kind": kind, "error": message[:300], "failure": failure.kind.value, "first_reporter": first,
                     "cause": cause, "time": t_detect}
        if self.moved_to is None:
            self._events.emit("fault_detected", **detection)
        else:  # woken, by a fault or by a stop: the next join tells which (a stopped rank detected no fault)
            self._woken_detection = detection
        t0 = time.monotonic()
        if g >= 0 and not self._watcher.wait_handled(self._pg_timeout_s):
            # The generation moved (declared above) but the watcher has not finished acting on it: its NCCL
            # abort would race the release below (expected only when the store stops answering).
            self._events.emit("watcher_late", rank=self._rank, generation=g, waited_s=self._pg_timeout_s)
        release()
        spent = self._judge.recovering(failure)
        if spent is not None:
            self.say_woken_detection(None)
            return spent
        self.timings = {"t_detect": t_detect, "abort_s": time.monotonic() - t0, "fault_step": float(step)}
        if cause is not None:
            self.timings["fault_time"] = float(cause.get("time", t_detect))
        return None

    def say_woken_detection(self, plan: ResumePlan | None) -> None:
        """A woken rank's ``fault_detected``, once its join answered (``plan``) or failed (None), with the
        cause that stands; none if the wake was a stop's (no fault was recorded), and no recovery counted."""
        detection, self._woken_detection = self._woken_detection, None
        if detection is None:
            return
        g = detection["generation"]
        # The plan carries the cause of the generation before it: this fault's only if it is g + 1's plan.
        cause = plan.cause if plan is not None and plan.generation == g + 1 else read_fault(self._store, g)
        if plan is None and cause is None:
            self._judge.not_recovering()
            return
        self._events.emit("fault_detected", **(detection | {"cause": cause}))

    def report(self, plan: ResumePlan, *, resume_step: int) -> None:
        """``recovery_done``, once the state stands at ``resume_step`` again (nothing after a fresh start).

        ``resume_step``: where the state stands now, whatever restored it: a live replica, a host snapshot or a
        buddy copy (plan.step), or the checkpoint all ranks agreed to load (plan.step is None for a disk resume).
        """
        self._store.add(Keys.restored(plan.generation), 1)
        if "t_detect" not in self.timings:
            return  # a fresh start, not a recovery
        t = self.timings
        fault_time = t.get("fault_time", float((plan.cause or {}).get("time", t["t_detect"])))
        self._events.emit(
            "recovery_done", rank=self._rank, generation=plan.generation, resume_step=resume_step,
            resume_from=plan.source.value, replacements=plan.replacements, healed=plan.healed,
            detect_s=max(0.0, t["t_detect"] - fault_time),
            abort_s=t["abort_s"], rendezvous_s=t["rendezvous_s"], heal_s=t["heal_s"],
            steps_redone=max(0, int(t["fault_step"]) - resume_step),
        )
        self.timings = {}


@contextmanager
def stop_on_storage_fault(store: dist.Store, events: EventLog, env: WorkerEnv, run_dir: Path | None) -> Iterator[None]:
    """Around a rank's start: a storage fault (its progress slot on a full or read-only disk) stops the job with
    its code (28, 74), since no replacement would fare better; anything else is raised as it is."""
    try:
        yield
    except OSError as exc:
        fault = storage_error_for(run_dir or Path("."), exc, what=f"starting rank {env.rank}")
        if fault is None:
            raise
        stood = request_stop(store, {"rank": env.rank, "summary": str(fault), "exit_code": fault.exit_code,
                                     "step": -1, "generation": -1})
        interrupt_for_stop(store, world_size=env.world_size)
        events.emit("job_stopped", rank=env.rank, reason=str(fault), exit_code=fault.exit_code, step=-1,
                    generation=-1, traceback="")
        if not env.under_agent:  # the agent says it once for the job
            print(f"resilient-train: rank {env.rank} stopped the job: {fault}", file=sys.stderr, flush=True)
        raise SystemExit(int(stood.get("exit_code", fault.exit_code))) from None
