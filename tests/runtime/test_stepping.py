"""The stepper (resilient_train/rank/stepping.py), in process: one step's phases, its vote and the boundary it publishes.

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

import pytest
import torch
from heart_rig import Rig

from monitors.events import read_events
from resilient_train.rank.context import StepContext
from resilient_train.rank.errors import GenerationFailed
from resilient_train.rank.local_state import decode_local

pytestmark = pytest.mark.timeout(60)


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
