"""The stepper (resilient_train/stepping.py), in process: one step's phases, its vote and the boundary it publishes.

What the design promises (docs/design.md, "The commit", "What a fault
leaves"): per step, the parts see the phases in order (data, forward,
backward, all-reduce, optimizer), the runtime's own marks only ever move
forward; the gradients go out bucket by bucket, and the vote rides after the
last bucket, cast only after the rank published the local state of the
boundary the step ends at (step + 1); a rank whose generation was declared
failed abstains and publishes nothing; the update happens after the commit.
A fault before the commit leaves the model and optimizer at the boundary, and
``rewind`` brings back the boundary's local state (its RNGs). Real tensors, a
real optimizer, the reduction forced through a real gloo group of one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from monitors.events import EventLog, read_events
from resilient_train.context import StepContext
from resilient_train.errors import GenerationFailed
from resilient_train.local_state import LocalSlots, decode_local
from resilient_train.parts import Part, Parts
from resilient_train.stepping import Stepper
from resilient_train.train_state import TrainState

pytestmark = pytest.mark.timeout(60)


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
        self.stepper = Stepper(state=self.state, rank=0, parts=Parts([self.trace]), rerun=None, slots=self.slots,
                               events=EventLog(self.events_path, source="test"), world_size=1,
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


@pytest.fixture
def rig(gloo_one: dist.Store, tmp_path: Path) -> Rig:
    return Rig(gloo_one, tmp_path)


def test_phases_in_order_and_the_vote_after_the_last_bucket_and_the_publication(rig: Rig) -> None:
    before = rig.params()
    rig.step(rig.train)
    seen = rig.trace.seen
    buckets = [s for s in seen if s[0] == "bucket"]
    assert len(buckets) == 1, "the plan was cut into two buckets"
    assert seen == [("data", False), ("forward", False), ("backward", False), ("all-reduce", False),
                    *buckets, ("last bucket", False),  # the gradients went out before the boundary was published
                    ("optimizer", True),  # the vote went out after the publication...
                    ("before_update", False)]  # ...and the gate let the update through
    assert not any(torch.equal(a, b) for a, b in zip(before, rig.params()))
    assert decode_local(rig.slots.read(0, 1))["step"] == 1
    assert rig.stepper.live == 1 and rig.stepper.published[0] == 1  # type: ignore[index]


def test_the_runtime_never_marks_a_phase_the_script_passed(rig: Rig) -> None:
    def step_fn(ctx: StepContext) -> torch.Tensor:
        loss = rig.model(torch.ones(2, 4)).sum()
        loss.backward()
        ctx.enter("optimizer")  # marked by the script before its reduction: nothing moves it back
        rig.stepper.reduce_gradients()
        rig.opt.step()
        return loss

    rig.step(step_fn)
    phases = [p for p, _ in rig.trace.seen if p not in ("bucket", "last bucket", "before_update")]
    assert phases == ["data", "optimizer"]


def test_an_abstaining_rank_publishes_nothing_and_changes_nothing(rig: Rig) -> None:
    before = rig.params()
    rig.trace.on_chunk = lambda: setattr(rig, "moved", True)  # declared failed while its gradients go out
    with pytest.raises(GenerationFailed, match="declared failed"):
        rig.step(rig.train)
    assert rig.slots.read(0, 1) is None  # abstained: no boundary 1
    assert all(torch.equal(a, b) for a, b in zip(before, rig.params()))
    assert "before_update" not in [p for p, _ in rig.trace.seen]
    assert rig.stepper.live == 0  # still at boundary 0: recoverable from here
    rig.moved = False
    rig.stepper.rewind(0)
    assert all(p.grad is None for p in rig.model.parameters())


def test_a_phase_started_in_a_failed_generation_raises(rig: Rig) -> None:
    rig.moved = True
    with pytest.raises(GenerationFailed, match="generation 0 was declared failed"):
        rig.stepper.enter("forward", 0)
    rig.stepper.enter("heal", 0)  # the runtime's own phases go on: a recovery is what comes next


def test_rewind_brings_back_the_boundarys_rng(rig: Rig) -> None:
    draws: list[torch.Tensor] = []

    def failing(ctx: StepContext) -> None:
        draws.append(torch.rand(3))  # the batch's randomness
        raise RuntimeError("the step failed before its commit")

    with pytest.raises(RuntimeError, match="before its commit"):
        rig.step(failing)
    rig.stepper.rewind(0)
    assert torch.equal(torch.rand(3), draws[0])


def test_local_state_changed_after_the_vote_is_published_again_once_told(rig: Rig) -> None:
    late = lambda: torch.rand(1)  # noqa: E731  (draws after the vote: the published boundary is stale)
    rig.step(lambda ctx: rig.train(ctx, after=late))
    assert torch.equal(decode_local(rig.slots.read(0, 1))["rng"]["torch"], torch.get_rng_state())
    rig.step(lambda ctx: rig.train(ctx, after=late))
    assert torch.equal(decode_local(rig.slots.read(0, 2))["rng"]["torch"], torch.get_rng_state())
    told = [e for e in read_events(rig.events_path) if e["event"] == "local_state_changed_after_reduction"]
    assert [e["step"] for e in told] == [1]
