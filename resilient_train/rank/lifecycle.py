"""The supervisor's lifecycle: states and the moves allowed between them.

::

    STARTING -> JOINING -> RESTORING -> TRAINING -> FINISHING -> DONE
                   ^                        |            |
                   |                        v            v
                   +------------------- RECOVERING <-----+
    (JOINING, RESTORING, FINISHING also move to RECOVERING; any state to FAILED)
"""

from __future__ import annotations

from enum import Enum

from resilient_train.base.transitions import IllegalTransition

__all__ = ["Lifecycle", "SupervisorState"]


class SupervisorState(str, Enum):
    STARTING = "starting"
    JOINING = "joining"
    RESTORING = "restoring"
    TRAINING = "training"
    FINISHING = "finishing"
    PREEMPTING = "preempting"  # a stop was agreed: the checkpoint of this boundary, then exit REQUEUE
    RECOVERING = "recovering"
    DONE = "done"
    FAILED = "failed"


_S = SupervisorState
_ALLOWED: dict[SupervisorState, frozenset[SupervisorState]] = {
    _S.STARTING: frozenset({_S.JOINING, _S.FAILED}),
    _S.JOINING: frozenset({_S.RESTORING, _S.RECOVERING, _S.DONE, _S.FAILED}),
    _S.RESTORING: frozenset({_S.TRAINING, _S.PREEMPTING, _S.RECOVERING, _S.FAILED}),
    _S.TRAINING: frozenset({_S.FINISHING, _S.PREEMPTING, _S.RECOVERING, _S.FAILED}),
    _S.PREEMPTING: frozenset({_S.DONE, _S.RECOVERING, _S.FAILED}),
    _S.FINISHING: frozenset({_S.DONE, _S.RECOVERING, _S.FAILED}),
    _S.RECOVERING: frozenset({_S.JOINING, _S.RECOVERING, _S.FAILED}),  # again: the store moved under it
    _S.DONE: frozenset(),
    _S.FAILED: frozenset(),
}


class Lifecycle:
    def __init__(self) -> None:
        self.state = SupervisorState.STARTING

    def to(self, new: SupervisorState) -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"{self.state.value} -> {new.value} is not allowed")
        self.state = new
