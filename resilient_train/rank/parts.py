"""The parts of the runtime that plug into the supervisor's loop, behind one small protocol.

The loop (:mod:`resilient_train.rank.supervisor`) owns the generations, the commit
and the healing; everything optional (progress reporting for the agent's
monitors, chaos injection, disk checkpoints, host snapshots, NVRx's CUPTI
scores, the rerun machine) is a :class:`Part` in a list, called at the same
few points. A part implements only the hooks it needs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from chaos import Fault, Injector, Phase
from chaos.faults import RECOVERY_PHASES
from chaos.values import ValueFaults
from monitors import ProgressReporter
from monitors.cupti_kernels import CuptiConfig, CuptiKernelScores
from monitors.events import EventLog
from resilient_train.rank.disk import DiskCheckpoints
from resilient_train.rank.snapshot import HostSnapshot
from resilient_train.protocol.store import Keys
from resilient_train.rank.train_state import TrainState

__all__ = ["ChaosPart", "CuptiPart", "DiskPart", "Part", "Parts", "ProgressPart", "SnapshotPart"]


class Part:
    """The hooks; each default does nothing."""

    def on_generation(self, generation: int, store: dist.Store) -> None:
        """A new generation's process group exists."""

    def on_restored(self, state: TrainState) -> None:
        """The state is restored (healed, or loaded); training starts next."""

    def on_phase(self, phase: str, step: int) -> None:
        """The main thread enters ``phase`` of ``step`` (a chaos fault may fire here)."""

    def on_loss(self, loss: torch.Tensor, step: int, data_rank: int) -> torch.Tensor:
        """The loss a step reports through ``ctx.loss``; returns the loss to use."""
        return loss

    def before_chunk(self, views: list[torch.Tensor], last: bool, step: int) -> None:
        """Local gradients about to be reduced (``last``: the chunk that carries the vote)."""

    def before_update(self) -> None:
        """The step is committed: the optimizer is about to change the state."""

    def before_release(self) -> None:
        """The generation's groups are about to be destroyed: drop every reference to them (a fault, or the end)."""

    def on_step_end(self, state: TrainState) -> None:
        """A step boundary: ``state.step`` steps are complete."""

    def close(self) -> None:
        """The run is over (or failed): release what the part holds."""


class Parts:
    """Calls every part's hook in order."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = list(parts)

    def of(self, kind: type) -> Any:
        return next((p for p in self.parts if isinstance(p, kind)), None)

    def on_generation(self, generation: int, store: dist.Store) -> None:
        for p in self.parts:
            p.on_generation(generation, store)

    def on_restored(self, state: TrainState) -> None:
        for p in self.parts:
            p.on_restored(state)

    def on_phase(self, phase: str, step: int) -> None:
        for p in self.parts:
            p.on_phase(phase, step)

    def on_loss(self, loss: torch.Tensor, step: int, data_rank: int) -> torch.Tensor:
        for p in self.parts:
            loss = p.on_loss(loss, step, data_rank)
        return loss

    def before_chunk(self, views: list[torch.Tensor], last: bool, step: int) -> None:
        for p in self.parts:
            p.before_chunk(views, last, step)

    def before_update(self) -> None:
        for p in self.parts:
            p.before_update()

    def on_step_end(self, state: TrainState) -> None:
        for p in self.parts:
            p.on_step_end(state)

    def before_release(self) -> None:
        for p in self.parts:
            p.before_release()

    def close(self) -> list[tuple[str, str]]:
        """Closes every part, the last first; returns ``(part, error)`` for each that failed to close."""
        errors = []
        for p in reversed(self.parts):
            try:
                p.close()
            except Exception as e:  # noqa: BLE001  (every part gets closed; the run's outcome stands)
                errors.append((type(p).__name__, f"{type(e).__name__}: {e}"))
        return errors


_SECTION_OF = {Phase.HEAL.value: "recovery", Phase.RENDEZVOUS.value: "recovery"}


class ProgressPart(Part):
    """The progress slot the agent's hang and straggler monitors read (main thread only)."""

    def __init__(self, reporter: ProgressReporter, generation: Callable[[], int] = lambda: 0) -> None:
        self.reporter = reporter
        # The generation the rank is in, or heading to once it left one: the hang detector tells a peer
        # still restoring into this rank's generation from one that went on to the next.
        self._generation = generation

    def on_phase(self, phase: str, step: int) -> None:
        self.reporter.enter(_SECTION_OF.get(phase, phase), step, generation=self._generation())

    def close(self) -> None:
        self.reporter.close()


class ChaosPart(Part):
    """Injected faults: at phases (kill, hang, raise, ...) and on values (NaN loss, flipped gradient bits).

    Each fault fires once per run, across replacements and launcher restarts:
    its claim is a marker file in the run directory (or a store counter without one).
    """

    def __init__(self, faults: list[Fault], *, rank: int, store: dist.Store, run_dir: Path | None,
                 events: EventLog, step: Callable[[], int]) -> None:
        self._rank, self._store, self._run_dir, self._events, self._step = rank, store, run_dir, events, step
        self._at = 0
        self.injector = Injector(faults, rank=rank, claim=self._claim, announce=self._announce)
        self.values = ValueFaults(faults, rank=rank, claim=self._claim, announce=self._announce)

    def _claim(self, index: int) -> bool:
        if self._run_dir is None:
            return self._store.add(Keys.chaos_fired(index), 1) == 1
        marker = self._run_dir / ".chaos" / f"fired-{index}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _announce(self, fault: Fault) -> None:
        step = self._at if fault.phase in RECOVERY_PHASES else self._step()  # a recovery's step is its resume step
        self._events.emit("fault_injected", rank=self._rank, pid=os.getpid(), kind=fault.kind.value,
                          phase=fault.phase.value, step=step)

    def __bool__(self) -> bool:
        return bool(self.injector) or bool(self.values)

    def on_phase(self, phase: str, step: int) -> None:
        if self.injector and phase in _PHASES:
            self._at = step
            self.injector.at(Phase(phase), step)

    def on_loss(self, loss: torch.Tensor, step: int, data_rank: int) -> torch.Tensor:
        return self.values.corrupt_loss(loss, step=step, data_rank=data_rank) if self.values else loss

    def before_chunk(self, views: list[torch.Tensor], last: bool, step: int) -> None:
        if last and self.values:
            self.values.corrupt_grads(views, step=step)


_PHASES = frozenset(p.value for p in Phase)


class CuptiPart(Part):
    """NVRx's CUPTI kernel scores, reported as events every ``report_every_steps`` (a collective)."""

    def __init__(self, config: CuptiConfig, events: EventLog) -> None:
        self.scores = CuptiKernelScores(config)
        self._events = events

    def on_generation(self, generation: int, store: dist.Store) -> None:
        self.scores.on_new_generation()

    def on_phase(self, phase: str, step: int) -> None:
        self.scores.enter(_SECTION_OF.get(phase, phase))

    def on_step_end(self, state: TrainState) -> None:
        if self.scores.due(state.step):
            report = self.scores.report(state.step)  # every rank, the same step
            if report is not None:
                self._events.emit("kernel_straggler_report", source="nvrx-cupti", **report)

    def close(self) -> None:
        self.scores.close()


class DiskPart(Part):
    """Periodic asynchronous disk checkpoints (and the fallback load, called by the loop)."""

    def __init__(self, disk: DiskCheckpoints, enter: Callable[[str, int], None], *, steps: int) -> None:
        self.disk = disk
        self._enter = enter
        self._step = 0
        self._last = steps  # the run's last step: its save is never skipped

    def on_generation(self, generation: int, store: dist.Store) -> None:
        self.disk.on_generation(store, generation)

    def on_restored(self, state: TrainState) -> None:
        self.disk.prepare(state)

    def on_step_end(self, state: TrainState) -> None:
        self._step = state.step
        self.disk.check_storage()
        if self.disk.config.should_save(state.step):
            self._enter("checkpoint", state.step)  # the save alone is the checkpoint section
            self.disk.save(state, required=state.step == self._last)

    def close(self) -> None:
        self._enter("checkpoint", self._step)  # a save in flight is finished (or given up) here
        self.disk.close()


class SnapshotPart(Part):
    """A host snapshot of the replicated state every ``every`` steps (``SupervisorConfig.snapshot_every``)."""

    def __init__(self, every: int, local: Callable[[], bytes]) -> None:
        self.every = every
        self.snapshot = HostSnapshot()
        self._local = local

    def on_step_end(self, state: TrainState) -> None:
        if state.step % self.every == 0:
            self.snapshot.capture(state.step, state.replicated_state_dict(), self._local())

    def before_update(self) -> None:
        self.snapshot.before_update()
