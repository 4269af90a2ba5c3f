"""The commit gate (resilient_train/rank/commit.py), in process: the optimizer applies a step only once every rank voted.

What the design promises (docs/design.md, "The commit"): the gate, the
optimizer's step pre-hook, reads the reduced vote; ``world_size`` means every
rank contributed and agreed, so the update may happen; anything less, a NaN,
or a generation declared failed while the step ran keeps the update out of the
optimizer. The stop flag rides with the vote. Buffers a failed step's forward
changed are put back (``BufferGuard``). Real tensors, a real optimizer and,
where votes are summed, a real gloo group of one: a gate that expects two
voters and gets one vote through the group is a step a peer abstained from.
"""

from __future__ import annotations

import math

import pytest
import torch

from resilient_train.rank.commit import BufferGuard, CommitGate, MicroStepDone, StepRejected
from resilient_train.rank.errors import GenerationFailed
from resilient_train.rank.reducer import GradientReducer, ReducerHooks

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """The gate's callbacks, counted; ``vote`` and ``stop`` are what this rank says."""

    def __init__(self, *, vote: float = 1.0, stop: float = 0.0) -> None:
        self.vote_value, self.stop_value = vote, stop
        self.moved = False
        self.calls: list[str] = []
        self.totals: list[float] = []
        self.at_update: list[object] = []  # what ``look()`` saw when the gate let the update through
        self.look = lambda: None

    def gate(self, *, world_size: int = 1) -> CommitGate:
        return CommitGate(world_size=world_size, group=lambda: None, device=torch.device("cpu"), vote=self.vote,
                          moved=lambda: self.moved, decide=self.decide, before_update=self.before_update,
                          on_optimizer=lambda: self.calls.append("optimizer phase"), stop=lambda: self.stop_value,
                          unreduced=lambda: self.calls.append("unreduced"))

    def vote(self) -> float:
        self.calls.append("vote")
        return self.vote_value

    def decide(self, total: float) -> None:
        self.calls.append("decide")
        self.totals.append(total)
        if math.isnan(total):
            raise StepRejected()

    def before_update(self) -> None:
        self.calls.append("before_update")
        self.at_update.append(self.look())


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def _backward(model: torch.nn.Module) -> None:
    model(torch.ones(3, 4)).sum().backward()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_full_vote_commits_once_per_step() -> None:
    rec = Recorder()
    gate = rec.gate()
    gate.begin_step()
    gate.commit()
    gate.commit()  # idempotent within a step: one vote, one decision
    assert rec.calls == ["vote", "decide", "before_update"] and rec.totals == [1.0] and gate.committed
    gate.begin_step()
    assert not gate.committed
    gate.commit()
    assert rec.calls.count("vote") == 2


def test_the_update_happens_only_after_the_gate_and_never_without_every_vote() -> None:
    model, opt = _model()
    rec = Recorder(vote=0.0)  # abstain: this rank's generation was declared failed
    gate = rec.gate()
    opt.register_step_pre_hook(gate.pre_hook)
    before = _params(model)
    gate.begin_step()
    _backward(model)
    with pytest.raises(GenerationFailed, match="only 0 of 1 ranks voted to commit the step"):
        opt.step()
    assert _same(_params(model), before) and "before_update" not in rec.calls

    rec.vote_value = 1.0
    rec.look = lambda: _same(_params(model), before)
    gate.begin_step()
    opt.step()
    assert rec.at_update == [True]  # the gate ran before the update...
    assert not _same(_params(model), before)  # ...and let it happen
    # No reduction carried the vote (FSDP, TP, a world of one): it goes out at the pre-hook, before the optimizer
    # phase begins.
    assert rec.calls == ["vote", "vote", "decide", "before_update", "optimizer phase"]


def test_a_missing_vote_through_a_real_group_fails_the_generation(gloo_one) -> None:
    rec = Recorder()
    gate = rec.gate(world_size=2)  # two voters expected; the group of one carries one vote: a peer abstained
    gate.begin_step()
    with pytest.raises(GenerationFailed, match="only 1 of 2 ranks voted"):
        gate.commit()
    assert rec.calls == ["unreduced", "vote"]  # no reducer carried the gradients: the misuse check is asked
    assert not gate.committed


def test_a_generation_declared_failed_while_the_step_ran_commits_nothing() -> None:
    rec = Recorder()
    rec.moved = True
    gate = rec.gate()
    gate.begin_step()
    with pytest.raises(GenerationFailed, match="declared failed while the step ran"):
        gate.commit()
    assert "decide" not in rec.calls and "before_update" not in rec.calls


def test_a_nan_vote_goes_to_the_rerun_flow_before_any_update() -> None:
    model, opt = _model()
    rec = Recorder(vote=float("nan"))
    gate = rec.gate()
    opt.register_step_pre_hook(gate.pre_hook)
    before = _params(model)
    gate.begin_step()
    _backward(model)
    with pytest.raises(StepRejected):
        opt.step()
    assert math.isnan(rec.totals[0]) and "before_update" not in rec.calls and _same(_params(model), before)


def test_the_stop_flag_rides_with_the_vote_and_is_agreed_through_the_group(gloo_one) -> None:
    rec = Recorder(stop=1.0)
    gate = rec.gate()
    gate.begin_step()
    gate.commit()
    assert gate.stop_agreed
    quiet = Recorder().gate(world_size=2)
    assert quiet.agree_stop() is False  # an all-reduce of the flags over the real group
    asking = Recorder(stop=1.0).gate(world_size=2)
    assert asking.agree_stop() is True


def test_the_vote_of_a_reduction_is_what_the_gate_reads(gloo_one) -> None:
    model, opt = _model()
    rec = Recorder(stop=0.0)
    gate = rec.gate()
    reducer = GradientReducer(list(model.parameters()), ReducerHooks(vote=rec.vote, stop=lambda: 1.0),
                              bucket_mb=0.0001, force=True)  # the collectives of a larger world, on the group
    gate.reducers.append(reducer)
    opt.register_step_pre_hook(gate.pre_hook)
    gate.begin_step()
    _backward(model)
    reducer.reduce_all()  # the buckets, then the vote and the stop flag, summed over the group
    opt.step()
    assert rec.calls == ["vote", "optimizer phase", "decide", "before_update"]  # voted once, in the reduction
    assert gate.stop_agreed  # the reduced stop flag, not the gate's own (0.0)


def test_a_suspended_gate_lets_the_optimizer_step_without_a_vote() -> None:
    model, opt = _model()
    rec = Recorder(vote=0.0)
    gate = rec.gate()
    opt.register_step_pre_hook(gate.pre_hook)
    before = _params(model)
    _backward(model)
    with gate.suspended():
        opt.step()
    assert rec.calls == [] and not _same(_params(model), before)


def test_a_micro_step_ends_at_the_gate_with_its_local_state_published() -> None:
    model, opt = _model()
    rec = Recorder()
    gate = rec.gate()
    published: list[int] = []
    gate.micro, gate.micro_done = 3, published.append
    opt.register_step_pre_hook(gate.pre_hook)
    before = _params(model)
    _backward(model)
    with pytest.raises(MicroStepDone):
        opt.step()
    assert published == [3] and rec.calls == [] and _same(_params(model), before)


def test_the_buffer_guard_puts_back_what_a_failed_forward_changed() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4))
    model[2].eval()  # its statistics do not move in forward
    guard = BufferGuard(model)
    guard.mark()  # boundary 0
    model(torch.randn(8, 4))  # step 0, committed
    guard.mark()  # boundary 1: the copy follows the committed step
    at_boundary = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(8, 4) * 5)  # step 1's forward, then a fault before its commit
    assert not torch.equal(model[1].running_mean, at_boundary["1.running_mean"])
    assert guard.restore() == 3  # running_mean, running_var, num_batches_tracked of the training BatchNorm
    assert all(torch.equal(v, at_boundary[k]) for k, v in model.state_dict().items())
    assert guard.restore() == 0
