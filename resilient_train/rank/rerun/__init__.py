"""The rerun state machine: tell transient faults, broken ranks and real numerical events apart.

See docs/design.md, "Rerun state machine". :mod:`.validators` is usable on
its own; :mod:`.machine` holds the states and the transition table;
:mod:`.policy` the configuration, exit codes and decision rules; :mod:`.driver`
the in-rank flow the supervisor runs after every step.
"""

from resilient_train.rank.rerun.driver import Outcome, RankExcluded, RerunDriver, RerunHooks
from resilient_train.rank.rerun.machine import Classification, IllegalRerunTransition, RerunMachine, RerunState
from resilient_train.rank.rerun.policy import (
    EXIT_RERUN_ELSEWHERE, EXIT_VALIDATION_FAILED, OnGenuine, RerunConfig, RerunMode, same_result,
)
from resilient_train.rank.rerun.validators import StepResult, ValidatorSet, Verdict

__all__ = [
    "EXIT_RERUN_ELSEWHERE",
    "EXIT_VALIDATION_FAILED",
    "Classification",
    "IllegalRerunTransition",
    "OnGenuine",
    "Outcome",
    "RankExcluded",
    "RerunConfig",
    "RerunDriver",
    "RerunHooks",
    "RerunMachine",
    "RerunMode",
    "RerunState",
    "StepResult",
    "ValidatorSet",
    "Verdict",
    "same_result",
]
