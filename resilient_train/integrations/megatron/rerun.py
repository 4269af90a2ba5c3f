"""Megatron's rerun state machine, in this runtime's words (and back).

Both machines tell the same three outcomes apart with the same modes and the
same exit codes; they differ in how a suspect is re-run elsewhere. Megatron
saves a checkpoint and exits 16 so that the job is restarted and the step
re-run on other GPUs; here a live peer recomputes the suspect's batch at once
(no checkpoint, no restart), and only a rank found persistently faulty exits
16, to be replaced. Exit 17 means the same in both: validation failed on a
genuine event, the last good state is saved.

Megatron's fault injector (``--error-injection-rate``,
``--error-injection-type``) becomes a list of this runtime's value faults
(:func:`injector_faults`), each of which its kind reproduces the way
Megatron's injected result does: a transient error differs on its re-run
(``nan``, once), a persistent one follows the process (``bitflip``), a
"correct result" follows the data (``spike``).

Nothing here imports megatron: the tests check the vocabulary against it.
"""

from __future__ import annotations

import random
from enum import Enum

from chaos import Fault
from resilient_train.base import exitcodes
from resilient_train.rank.rerun import Classification, OnGenuine, RerunConfig, RerunMode, RerunState

__all__ = [
    "MEGATRON_EXIT_CODES", "MegatronDiagnostic", "MegatronRerunState", "classification_of", "diagnostic_of",
    "injector_faults", "rerun_config", "state_of",
]

# Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE and EXIT_CODE_FAILED_ON_RESULT_VALIDATION.
MEGATRON_EXIT_CODES = {16: exitcodes.RERUN_ELSEWHERE, 17: exitcodes.VALIDATION_FAILED}


class MegatronDiagnostic(str, Enum):
    """Megatron's ``RerunDiagnostic`` values."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class MegatronRerunState(str, Enum):
    """Megatron's ``RerunState`` names."""

    NOT_RUNNING_YET = "NOT_RUNNING_YET"
    INITIAL_RUN = "INITIAL_RUN"
    RERUNNING_IN_PLACE = "RERUNNING_IN_PLACE"
    WILL_RERUN_FROM_CHECKPOINT = "WILL_RERUN_FROM_CHECKPOINT"
    RERUNNING_FROM_CHECKPOINT = "RERUNNING_FROM_CHECKPOINT"
    RERUNNING_AGAIN_FROM_CHECKPOINT = "RERUNNING_AGAIN_FROM_CHECKPOINT"


_DIAGNOSTIC = {
    Classification.TRANSIENT: MegatronDiagnostic.TRANSIENT_ERROR,
    Classification.PERSISTENT: MegatronDiagnostic.PERSISTENT_ERROR,
    Classification.GENUINE: MegatronDiagnostic.CORRECT_RESULT,
}

# Megatron's "from checkpoint" states are ours "on a peer": the re-run elsewhere, without the restart.
_STATE = {
    MegatronRerunState.NOT_RUNNING_YET: RerunState.HEALTHY,
    MegatronRerunState.INITIAL_RUN: RerunState.HEALTHY,
    MegatronRerunState.RERUNNING_IN_PLACE: RerunState.RERUN_IN_PLACE,
    MegatronRerunState.WILL_RERUN_FROM_CHECKPOINT: RerunState.RERUN_ON_PEER,
    MegatronRerunState.RERUNNING_FROM_CHECKPOINT: RerunState.RERUN_ON_PEER,
    MegatronRerunState.RERUNNING_AGAIN_FROM_CHECKPOINT: RerunState.RERUN_ON_PEER,
}

_INJECTED_KIND = {
    MegatronDiagnostic.TRANSIENT_ERROR: "nan",  # once: the re-run in place differs
    MegatronDiagnostic.PERSISTENT_ERROR: "bitflip",  # stays with the process: a peer's re-run differs
    MegatronDiagnostic.CORRECT_RESULT: "spike",  # follows the batch: every re-run agrees
}
_INJECTED_PHASE = {"nan": "forward", "bitflip": "backward", "spike": "forward"}


def diagnostic_of(classification: Classification | str) -> MegatronDiagnostic:
    return _DIAGNOSTIC[Classification(classification)]


def classification_of(diagnostic: MegatronDiagnostic | str) -> Classification:
    d = MegatronDiagnostic(getattr(diagnostic, "value", diagnostic))
    return next(c for c, m in _DIAGNOSTIC.items() if m is d)


def state_of(state: MegatronRerunState | str) -> RerunState:
    """Our state for one of Megatron's (its ``RerunState`` member, or the member's name)."""
    return _STATE[MegatronRerunState(getattr(state, "name", state))]


def rerun_config(*, rerun_mode: str = "disabled", check_for_spiky_loss: bool = True, spike_factor: float = 10.0,
                 exit_on_genuine: bool = False) -> RerunConfig:
    """A :class:`RerunConfig` from Megatron's flags (``--rerun-mode``, ``--check-for-spiky-loss``).

    Megatron stops a job whose rejected result reproduces everywhere (exit
    17); ``exit_on_genuine=False`` skips the batch instead (this runtime's default).
    """
    return RerunConfig(mode=RerunMode(rerun_mode), loss_spike_factor=spike_factor if check_for_spiky_loss else None,
                       on_genuine=OnGenuine.STOP if exit_on_genuine else OnGenuine.SKIP)


def injector_faults(*, rate: int, kind: MegatronDiagnostic | str, steps: int, world_size: int,
                    seed: int = 0) -> list[Fault]:
    """Megatron's error injector over ``steps`` steps, drawn once, as a list of value faults.

    Megatron injects on a rank when ``(randint(0, rate - 1) + rank) % rate == 0``
    at each validated step, at most once per step; here the draws come from
    ``random.Random(seed)``, one per step and rank, so the same arguments give
    the same faults (a chaos scenario can be re-run). ``rate`` 0 injects nothing.
    """
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 0:
        raise ValueError(f"rate must be an integer >= 0, got {rate!r}")
    diagnostic = MegatronDiagnostic(getattr(kind, "value", kind))
    chaos_kind = _INJECTED_KIND[diagnostic]
    if rate == 0:
        return []
    rng = random.Random(seed)
    faults = []
    for step in range(steps):
        for rank in range(world_size):
            if (rng.randint(0, rate - 1) + rank) % rate == 0:
                faults.append(Fault(kind=chaos_kind, rank=rank, step=step, phase=_INJECTED_PHASE[chaos_kind]))
    return faults
