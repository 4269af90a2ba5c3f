"""What a step function sees: its rank, the step, the named phases, and the runtime's few entry points."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from chaos import Phase

if TYPE_CHECKING:
    from resilient_train.supervisor import Supervisor

__all__ = ["StepContext", "StepFn"]


class StepContext:
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

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The current generation's process group (a new one after every recovery)."""
        return self._sup.group

    def enter(self, phase: Phase | str) -> None:
        """Marks the start of a phase: faults are noticed and injected here."""
        self.phase = Phase(phase)
        self._sup._enter(self.phase.value, self.step)

    def average_gradients(self) -> None:
        """The data-parallel gradient reduction (the fixed bucket plan, with the commit vote), as its own phase."""
        self.enter(Phase.ALL_REDUCE)
        self._sup._reduce_gradients()

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Reports the step's loss before ``backward``; use the tensor it returns (value faults apply here)."""
        return self._sup._on_loss(loss)


StepFn = Callable[[StepContext], Any]
