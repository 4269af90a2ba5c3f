"""The rerun state machine's parts, in one process: validators, transitions, policy rules, the driver's decisions."""

from __future__ import annotations

import json
import math

import pytest

from resilient_train.rank.rerun import (
    Classification, IllegalRerunTransition, OnGenuine, Outcome, RankExcluded, RerunConfig, RerunDriver, RerunHooks,
    RerunMachine, RerunMode, RerunState, StepResult, ValidatorSet, same_result,
)
from resilient_train.rank.rerun.policy import peer_for, swap_assignment


def _warm(v: ValidatorSet, n: int = 5, loss: float = 2.0, gn: float = 1.0) -> None:
    for _ in range(n):
        v.commit(StepResult(loss, gn))


@pytest.mark.timeout(10)
def test_validators_nan_inf_and_spikes():
    v = ValidatorSet(loss_spike_factor=10.0, grad_norm_spike_factor=10.0, window=10, min_history=3)
    assert v.check(StepResult(math.nan, 1.0)).reason == "nan_loss"
    assert v.check(StepResult(1.0, math.inf)).reason == "nan_grad_norm"
    assert v.check(StepResult(1e6, 1e6)).accepted, "no spike can be judged before min_history steps"
    _warm(v, 3)
    assert v.check(StepResult(19.9, 1.0)).accepted
    spike = v.check(StepResult(20.1, 1.0))
    assert (spike.accepted, spike.reason, spike.limit) == (False, "loss_spike", 20.0)
    assert v.check(StepResult(2.0, 10.5)).reason == "grad_norm_spike"
    assert v.check(StepResult(2.0, None)).accepted, "no gradient norm, no gradient check"


@pytest.mark.timeout(10)
def test_validators_user_check_history_and_state_roundtrip():
    v = ValidatorSet(checks=[lambda r: "negative" if r.loss < 0 else None], window=3, min_history=1)
    assert v.check(StepResult(-1.0)).reason == "negative"
    for x in (1.0, 2.0, 3.0, 4.0):
        v.commit(StepResult(x, x))
    assert list(v.loss_history.values) == [2.0, 3.0, 4.0], "the window keeps the newest values"
    w = ValidatorSet(window=3, min_history=1)
    w.load_state_dict(json.loads(json.dumps(v.state_dict())))
    assert list(w.loss_history.values) == [2.0, 3.0, 4.0] and list(w.grad_history.values) == [2.0, 3.0, 4.0]
    with pytest.raises(ValueError):
        ValidatorSet(loss_spike_factor=0.5)


@pytest.mark.timeout(10)
def test_machine_transition_table_raises_on_illegal_moves():
    m = RerunMachine()
    with pytest.raises(IllegalRerunTransition):
        m.to(RerunState.TRANSIENT)  # a classification needs a re-run first
    m.to(RerunState.RERUN_IN_PLACE)
    with pytest.raises(IllegalRerunTransition):
        m.to(RerunState.GENUINE)  # genuine needs a peer's opinion
    m.to(RerunState.RERUN_ON_PEER)
    m.to(RerunState.GENUINE)
    m.to(RerunState.STOPPED)
    with pytest.raises(IllegalRerunTransition):
        m.to(RerunState.HEALTHY)  # stopped is final
    m2 = RerunMachine()
    m2.to(RerunState.RERUN_IN_PLACE)
    m2.abort()
    assert m2.state is RerunState.HEALTHY


@pytest.mark.timeout(10)
def test_machine_state_is_json_and_restores():
    m = RerunMachine(ValidatorSet(min_history=1))
    m.validators.commit(StepResult(2.0, 1.0))
    m.classify(Classification.PERSISTENT, {"rank": 2, "step": 8})
    sd = json.loads(json.dumps(m.state_dict()))
    fresh = RerunMachine(ValidatorSet(min_history=1))
    fresh.load_state_dict(sd)  # a replacement, or a job restarted from a checkpoint
    assert fresh.suspects == [2] and fresh.counters["persistent"] == 1
    assert list(fresh.validators.loss_history.values) == [2.0]
    # A survivor rolled back to this snapshot after deciding more: its validators roll back, its record does not.
    m.classify(Classification.TRANSIENT, {"rank": 1, "step": 9})
    m.validators.commit(StepResult(3.0, 1.0))
    m.load_state_dict(sd)
    assert list(m.validators.loss_history.values) == [2.0]
    assert m.counters["transient"] == 1 and m.suspects == [2]


@pytest.mark.timeout(10)
def test_policy_rules():
    assert same_result(StepResult(math.nan, 1.0), StepResult(math.nan, 1.0))
    assert not same_result(StepResult(0.0, 1.0), StepResult(-0.0, 1.0))
    assert not same_result(StepResult(1.0, None), StepResult(1.0, 1.0))
    assert peer_for(3, [3], 4) == 0 and peer_for(1, [1, 2], 4) == 3 and peer_for(0, [0], 1) is None
    assert swap_assignment(4, 2, 3) == [0, 1, 3, 2]
    with pytest.raises(ValueError):
        RerunConfig(mode="validate")


class _World:
    """A scripted world of ranks around the driver of rank 0: the other ranks' rows, call by call."""

    def __init__(self, others: list[list[StepResult | None]], codes: list[list[int]]):
        self.others, self.codes, self.calls = others, codes, 0
        self.rewound: list[int] = []
        self.exits: list[int] = []

    def exchange(self, row: list[float]) -> list[list[float]]:
        i, self.calls = self.calls, self.calls + 1
        table = [row]
        for r, res in enumerate(self.others[i]):
            gn = res.grad_norm if res.grad_norm is not None else math.nan
            table.append([float(self.codes[i][r]), res.loss, gn, 0.0 if res.grad_norm is None else 1.0])
        return table

    def hooks(self) -> RerunHooks:
        def exit_(code: int):
            self.exits.append(code)
            raise SystemExit(code)

        return RerunHooks(exchange=self.exchange, rewind=self.rewound.append, save=lambda step: "saved",
                          exit=exit_, publish=lambda k, v: None)


def _driver(world: _World, **cfg) -> tuple[RerunDriver, list[dict]]:
    events: list[dict] = []
    d = RerunDriver(RerunConfig(mode=RerunMode.VALIDATE_RESULTS, **cfg), rank=0, world_size=2,
                    emit=lambda name, **f: events.append({"event": name, **f}), hooks=world.hooks())
    _warm(d.machine.validators)
    return d, events


GOOD = StepResult(2.0, 1.0)


@pytest.mark.timeout(10)
def test_driver_transient_persistent_genuine():
    # Rank 1 rejects (NaN), its re-run is fine: transient, the re-run is kept.
    w = _World([[StepResult(math.nan, math.nan)], [GOOD]], [[1], [0]])
    d, ev = _driver(w)
    assert d.resolve(7, GOOD, lambda as_rank: GOOD) is Outcome.KEEP
    assert [e["classification"] for e in ev if e["event"] == "rerun_decision"] == ["transient"]
    assert d.machine.state is RerunState.HEALTHY

    # Rank 1 reproduces its Inf; rank 0 computing rank 1's batch gets a finite norm: persistent, rank 1 excluded.
    bad = StepResult(2.0, math.inf)
    w = _World([[bad], [bad], [GOOD]], [[2], [2], [0]])
    d, ev = _driver(w)
    computed_as: list[int] = []
    with pytest.raises(RankExcluded):
        d.resolve(7, GOOD, lambda as_rank: computed_as.append(as_rank) or GOOD)
    assert computed_as == [0, 1], "a re-run in place, then rank 1's batch"
    assert d.machine.suspects == [1] and d.machine.counters["persistent"] == 1

    # Rank 1 reproduces a spike and rank 0 gets the same spike on its batch: genuine; skip rolls the step back.
    spike = StepResult(2000.0, 1.0)
    w = _World([[spike], [spike], [GOOD]], [[3], [3], [0]])
    d, ev = _driver(w)
    assert d.resolve(7, GOOD, lambda as_rank: spike if as_rank == 1 else GOOD) is Outcome.SKIP
    assert w.rewound == [7] and d.machine.counters["genuine"] == 1

    # The same with the stop policy: the state is saved and the rank exits 17.
    w = _World([[spike], [spike], [GOOD]], [[3], [3], [0]])
    d, ev = _driver(w, on_genuine=OnGenuine.STOP)
    with pytest.raises(SystemExit):
        d.resolve(7, GOOD, lambda as_rank: spike if as_rank == 1 else GOOD)
    assert w.exits == [17] and d.machine.state is RerunState.STOPPED
    assert [e for e in ev if e["event"] == "rerun_stop"][0]["saved"] == "saved"


@pytest.mark.timeout(10)
def test_machine_travels_in_the_rank_local_state():
    """Registered in TrainState.runtime, the machine is in every snapshot, published local state and checkpoint."""
    import torch

    from resilient_train.rank.local_state import decode_local, encode_local
    from resilient_train.rank.train_state import TrainState

    w = _World([], [])
    d, _ = _driver(w)
    d.machine.classify(Classification.GENUINE, {"rank": 1, "step": 3})
    state = TrainState(model=torch.nn.Linear(2, 2))
    state.runtime["rerun"] = d.stateful()
    blob = encode_local(state.local_state_dict())
    d2, _ = _driver(_World([], []))
    other = TrainState(model=torch.nn.Linear(2, 2))
    other.runtime["rerun"] = d2.stateful()
    other.load_local(decode_local(blob))
    assert d2.machine.counters["genuine"] == 1
    assert list(d2.machine.validators.loss_history.values) == list(d.machine.validators.loss_history.values)


@pytest.mark.timeout(10)
def test_a_persistent_verdict_that_follows_the_replacement_is_genuine():
    """Rank 1 was excluded at step 7; its replacement reproduces the same values and the peer still differs."""
    bad = StepResult(2.0, math.inf)
    w = _World([[bad], [bad], [GOOD]], [[2], [2], [0]])
    d, ev = _driver(w)
    d.machine.classify(Classification.PERSISTENT, {"rank": 1, "step": 7})
    assert d.resolve(7, GOOD, lambda as_rank: GOOD) is Outcome.SKIP
    (decision,) = [e for e in ev if e["event"] == "rerun_decision"]
    assert decision["classification"] == "genuine" and "replacement" in decision["note"]

