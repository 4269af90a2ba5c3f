"""What a step function sees: its rank, the step, the named phases, and the runtime's few entry points."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from chaos import Phase

__all__ = ["StepContext", "StepFn", "StepRuntime"]


class StepRuntime(Protocol):
    """What a step context asks of the runtime below it (the :class:`~resilient_train.rank.stepping.Stepper`)."""

    @property
    def generation(self) -> int: ...

    @property
    def group(self) -> dist.ProcessGroup | None: ...

    def enter(self, phase: str, step: int) -> None: ...

    def reduce_gradients(self) -> None: ...

    def on_loss(self, loss: torch.Tensor, step: int, data_rank: int) -> torch.Tensor: ...


class StepContext:
    def __init__(self, runtime: StepRuntime, *, rank: int, world_size: int, device: torch.device) -> None:
        self._runtime = runtime
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.step = 0
        self.phase: Phase = Phase.BETWEEN_STEPS
        # Whose batch this computation is: another rank's when a peer re-runs it (data = f(seed, step, data_rank)).
        self.data_rank = self.rank

    @property
    def generation(self) -> int:
        return self._runtime.generation

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The current generation's process group (a new one after every recovery)."""
        return self._runtime.group

    def enter(self, phase: Phase | str) -> None:
        """Marks the start of a phase: faults are noticed and injected here."""
        self.phase = Phase(phase)
        self._runtime.enter(self.phase.value, self.step)

    def average_gradients(self) -> None:
        """The data-parallel gradient reduction (the fixed bucket plan, with the commit vote), as its own phase."""
        self.enter(Phase.ALL_REDUCE)
        self._runtime.reduce_gradients()

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Reports the step's loss before ``backward``; use the tensor it returns (value faults apply here)."""
        return self._runtime.on_loss(loss, self.step, self.data_rank)


StepFn = Callable[[StepContext], Any]
