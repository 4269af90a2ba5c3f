"""The rerun machine as a part of the supervisor's loop.

It measures each computation (the loss reported through ``ctx.loss`` and the
local gradient norm before the reduction), puts this rank's verdict in the
commit vote (NaN: rejected), and, when somebody rejected, runs the re-run
flow of :class:`resilient_train.rank.rerun.RerunDriver` before anything is
committed: the state is still at the step's boundary, so a re-run needs no
snapshot, only the rank-local state (RNG, data position) of the boundary,
which is in the store. A re-run computes the step up to its commit and stops
there (:class:`~resilient_train.rank.commit.StepMeasured`).
"""

from __future__ import annotations

import json
import math
from enum import Enum
from typing import Any, Callable

import torch

from resilient_train.rank.commit import StepMeasured, StepRejected
from resilient_train.rank.parts import Part
from resilient_train.rank.rerun.driver import RECORD_KEY, Outcome, RerunDriver, RerunHooks
from resilient_train.rank.rerun.policy import RerunConfig, RerunMode
from resilient_train.rank.rerun.validators import StepResult
from resilient_train.rank.train_state import TrainState, as_float

__all__ = ["ComputeMode", "DeterminismDue", "RerunPart"]


class ComputeMode(str, Enum):
    COMMIT = "commit"  # a normal step: validated, committed if every rank agrees
    ACCEPT = "accept"  # the flow decided to keep this step: committed without another verdict
    MEASURE = "measure"  # a re-run: stops at the commit with its result


class DeterminismDue(StepRejected):
    """report_determinism_stats: this step is re-run and compared before it is committed."""


class RerunPart(Part):
    def __init__(self, config: RerunConfig, *, rank: int, world_size: int, emit: Callable[..., Any],
                 hooks: RerunHooks, device_index: int | None) -> None:
        self.config = config
        self.driver = RerunDriver(config, rank=rank, world_size=world_size, emit=emit, hooks=hooks)
        self.driver.device_index = device_index
        self.mode = ComputeMode.COMMIT
        self._loss: torch.Tensor | None = None
        self._norm_sq: torch.Tensor | None = None
        self._checked: int | None = None  # the step whose determinism was checked

    # ------------------------------------------------------------ measuring
    def begin(self, mode: ComputeMode) -> None:
        self.mode = mode
        self._loss = None
        self._norm_sq = None

    def on_loss(self, loss: torch.Tensor, step: int, data_rank: int) -> torch.Tensor:
        self._loss = loss.detach()
        return loss

    def before_chunk(self, views: list[torch.Tensor], last: bool, step: int) -> None:
        if views:
            sq = torch.stack([torch.linalg.vector_norm(v.float()) for v in views]).pow(2).sum()
            self._norm_sq = sq if self._norm_sq is None else self._norm_sq + sq

    def result(self, out: Any = None) -> StepResult:
        loss = as_float(self._loss if self._loss is not None else out)
        if loss is None:
            raise ValueError("rerun validation needs the step's loss: pass it to ctx.loss() before the commit")
        norm = None if self._norm_sq is None else math.sqrt(float(self._norm_sq))
        return StepResult(loss=loss, grad_norm=norm)

    # ------------------------------------------------------------- the vote
    def vote(self) -> float:
        """This rank's verdict, before its vote goes out (and before the next boundary is published)."""
        if self.mode is not ComputeMode.COMMIT or self.config.mode is not RerunMode.VALIDATE_RESULTS:
            return 1.0
        result = self.result()
        if not self.driver.precheck(result):
            return math.nan
        self.driver.accept(result)  # the history of the boundary it ends at
        return 1.0

    def at_gate(self, step: int, total: float) -> None:
        """Raises out of the user's step unless this computation commits."""
        if self.mode is ComputeMode.MEASURE:
            raise StepMeasured()
        if math.isnan(total):
            raise StepRejected()
        if (self.mode is ComputeMode.COMMIT and self.config.mode is RerunMode.REPORT_DETERMINISM_STATS
                and step % self.config.determinism_interval == 0 and self._checked != step):
            raise DeterminismDue()

    # ------------------------------------------------------------- the flow
    def resolve(self, exc: StepRejected, step: int, recompute: Callable[[int], StepResult]) -> Outcome:
        """The flow after a rejection (or a determinism check); the caller then recomputes to commit (KEEP)."""
        first = self.result()
        if isinstance(exc, DeterminismDue):
            self.driver.determinism(step, first, recompute)
            self._checked = step
            return Outcome.KEEP
        return self.driver.resolve(step, first, recompute)

    def adopt_newest_record(self, store: Any) -> None:
        """A replacement takes the newest decision record (its predecessor may have been excluded after it)."""
        if store.check([RECORD_KEY]):
            self.driver.adopt_record(json.loads(store.get(RECORD_KEY)))

    def on_restored(self, state: TrainState) -> None:
        self.driver.machine.abort()

    def close(self) -> None:
        self.driver.emit("rerun_summary", rank=self.driver.rank, **self.driver.summary())
