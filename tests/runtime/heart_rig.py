"""A stepper over a real model, optimizer, store and gloo group of one, for the heart's in-process tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from monitors.events import EventLog
from resilient_train.rank.context import StepContext
from resilient_train.rank.local_state import LocalSlots
from resilient_train.rank.parts import Part, Parts
from resilient_train.rank.stepping import Stepper
from resilient_train.rank.train_state import TrainState


class Trace(Part):
    """What the stepper shows its parts, each with whether the next boundary was published by then."""

    def __init__(self, slots: LocalSlots) -> None:
        self.slots = slots
        self.seen: list[tuple[str, bool]] = []
        self.on_chunk: Callable[[], None] = lambda: None

    def _published(self, step: int) -> bool:
        return self.slots.read(0, step + 1) is not None

    def on_phase(self, phase: str, step: int) -> None:
        self.seen.append((phase, self._published(step)))

    def before_chunk(self, views: list[torch.Tensor], last: bool, step: int) -> None:
        self.seen.append(("last bucket" if last else "bucket", self._published(step)))
        self.on_chunk()

    def before_update(self) -> None:
        self.seen.append(("before_update", False))


class Rig:
    def __init__(self, store: dist.Store, run_dir: Path) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3))  # two buckets of the plan
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.state = TrainState(model=self.model, optimizer=self.opt)
        self.slots = LocalSlots(store)
        self.trace = Trace(self.slots)
        self.moved = False
        self.events_path = run_dir / "events.jsonl"
        self.events = EventLog(self.events_path, source="test")
        self.stepper = Stepper(state=self.state, rank=0, parts=Parts([self.trace]), rerun=None, slots=self.slots,
                               events=self.events, world_size=1,
                               device=torch.device("cpu"), chunk_mb=0.00002, generation=lambda: 0,
                               group=lambda: None, moved=lambda: self.moved, training=lambda: True,
                               force_reduction=True)  # the collectives of a larger world, on the group of one
        self.stepper.publish_start(0)
        self.stepper.restored(0)

    def step(self, step_fn: Callable[[StepContext], Any]) -> None:
        """One step as the supervisor runs it."""
        self.stepper.run_step(step_fn, self.state.step)
        self.state.step += 1
        self.stepper.end_boundary()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def train(self, ctx: StepContext, *, after: Callable[[], None] = lambda: None) -> torch.Tensor:
        """A script's step with its phases marked, as a DDP wrapper marks them."""
        ctx.enter("forward")
        loss = self.model(torch.ones(2, 4) * (ctx.step + 1)).sum()
        ctx.enter("backward")
        loss.backward()
        ctx.average_gradients()
        self.opt.step()
        after()
        return loss
