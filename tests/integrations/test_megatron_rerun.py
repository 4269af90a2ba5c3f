"""Megatron's rerun vocabulary, exit codes and fault injector, in this runtime's terms."""

from __future__ import annotations

import pytest

from chaos import dumps_faults, loads_faults
from resilient_train.base import exitcodes
from resilient_train.integrations.megatron import rerun as mr
from resilient_train.rank.rerun import Classification, OnGenuine, RerunMode, RerunState
from resilient_train.rank.rerun.machine import TRANSITIONS

pytestmark = pytest.mark.timeout(60)


def _megatron():
    return pytest.importorskip("megatron.core.rerun_state_machine",
                               reason="megatron-core is not installed (pip install 'resilient-train[megatron]')")


def test_exit_codes_and_modes_are_megatrons():
    rsm = _megatron()
    assert mr.MEGATRON_EXIT_CODES == {rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE: exitcodes.RERUN_ELSEWHERE,
                                      rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION: exitcodes.VALIDATION_FAILED}
    assert {m.value for m in rsm.RerunMode} == {m.value for m in RerunMode}
    assert {d.value for d in rsm.RerunDiagnostic} == {d.value for d in mr.MegatronDiagnostic}
    assert {s.name for s in rsm.RerunState} == {s.value for s in mr.MegatronRerunState}


def test_every_megatron_state_and_diagnostic_maps():
    rsm = _megatron()
    for s in rsm.RerunState:
        assert isinstance(mr.state_of(s), RerunState)
    assert mr.state_of(rsm.RerunState.RERUNNING_IN_PLACE) is RerunState.RERUN_IN_PLACE
    assert mr.state_of("WILL_RERUN_FROM_CHECKPOINT") is RerunState.RERUN_ON_PEER
    for d in rsm.RerunDiagnostic:
        assert mr.diagnostic_of(mr.classification_of(d)).value == d.value
    assert mr.classification_of(rsm.RerunDiagnostic.CORRECT_RESULT) is Classification.GENUINE
    assert mr.diagnostic_of(Classification.PERSISTENT) is mr.MegatronDiagnostic.PERSISTENT_ERROR


def test_megatron_flow_is_a_path_of_our_machine():
    # Megatron: initial run -> re-run in place -> (reproduces) re-run elsewhere. The same path is legal here.
    path = ["INITIAL_RUN", "RERUNNING_IN_PLACE", "WILL_RERUN_FROM_CHECKPOINT"]
    ours = [mr.state_of(s) for s in path]
    for a, b in zip(ours, ours[1:]):
        assert a is b or b in TRANSITIONS[a], (a, b)


def test_rerun_config_from_megatron_flags():
    c = mr.rerun_config(rerun_mode="validate_results", check_for_spiky_loss=True, exit_on_genuine=True)
    assert c.mode is RerunMode.VALIDATE_RESULTS and c.loss_spike_factor == 10.0 and c.on_genuine is OnGenuine.STOP
    off = mr.rerun_config(rerun_mode="report_determinism_stats", check_for_spiky_loss=False)
    assert off.loss_spike_factor is None and off.on_genuine is OnGenuine.SKIP
    with pytest.raises(ValueError):
        mr.rerun_config(rerun_mode="sometimes")


def test_injector_faults_are_deterministic_and_parse_as_chaos():
    a = mr.injector_faults(rate=10, kind="transient_error", steps=200, world_size=4, seed=3)
    b = mr.injector_faults(rate=10, kind=mr.MegatronDiagnostic.TRANSIENT_ERROR, steps=200, world_size=4, seed=3)
    assert a == b and a  # the same draws, and some faults in 800 draws at 1 in 10
    assert 40 <= len(a) <= 120  # about 1 in 10 of 800 (wide: a binomial's 5-sigma band)
    assert loads_faults(dumps_faults(a)) == a
    assert {f.kind.value for f in a} == {"nan"}
    assert {f.kind.value for f in mr.injector_faults(rate=5, kind="persistent_error", steps=50, world_size=2)} == \
        {"bitflip"}
    assert {f.kind.value for f in mr.injector_faults(rate=5, kind="correct_result", steps=50, world_size=2)} == \
        {"spike"}
    assert mr.injector_faults(rate=0, kind="transient_error", steps=50, world_size=2) == []
    with pytest.raises(ValueError):
        mr.injector_faults(rate=-1, kind="transient_error", steps=5, world_size=1)
