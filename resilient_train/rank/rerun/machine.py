"""The rerun state machine: explicit states, a transition table, and a JSON-able record.

::

    HEALTHY --(a rank rejects its step)--> RERUN_IN_PLACE --(the suspect's result differs)--> TRANSIENT --> HEALTHY
       |                                        |
       |                                        +--(it reproduces)--> RERUN_ON_PEER --(peer differs)--> PERSISTENT --> HEALTHY
       |                                                                  |   ^            (the rank is excluded and replaced)
       |                                                                  +---+ (next suspect)
       |                                                                  +--(peer agrees)--> GENUINE --> HEALTHY (skip the batch)
       |                                                                                         +-----> STOPPED (save, exit 17)
       +--(report_determinism_stats, every N-th step)--> DETERMINISM_CHECK --> HEALTHY

A fault of the run itself (a dead peer, a new generation) during a re-run
aborts the flow: RERUN_IN_PLACE, RERUN_ON_PEER and DETERMINISM_CHECK may also
go back to HEALTHY. Every rank drives its own machine through the same moves,
because every move follows a decision taken from values all ranks share.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Any

from resilient_train.rank.rerun.validators import ValidatorSet

__all__ = ["Classification", "IllegalRerunTransition", "RerunMachine", "RerunState"]


class RerunState(str, Enum):
    HEALTHY = "healthy"
    DETERMINISM_CHECK = "determinism_check"
    RERUN_IN_PLACE = "rerun_in_place"
    RERUN_ON_PEER = "rerun_on_peer"
    TRANSIENT = "transient"
    PERSISTENT = "persistent"
    GENUINE = "genuine"
    STOPPED = "stopped"


class Classification(str, Enum):
    TRANSIENT = "transient"  # the re-run differs: a passing glitch, keep the re-run
    PERSISTENT = "persistent"  # a healthy peer computes something else: the rank is broken
    GENUINE = "genuine"  # a healthy peer computes the same: the model or the data did it


_S = RerunState
TRANSITIONS: dict[RerunState, frozenset[RerunState]] = {
    _S.HEALTHY: frozenset({_S.RERUN_IN_PLACE, _S.DETERMINISM_CHECK}),
    _S.DETERMINISM_CHECK: frozenset({_S.HEALTHY}),
    _S.RERUN_IN_PLACE: frozenset({_S.TRANSIENT, _S.RERUN_ON_PEER, _S.HEALTHY}),
    _S.RERUN_ON_PEER: frozenset({_S.RERUN_ON_PEER, _S.PERSISTENT, _S.GENUINE, _S.HEALTHY}),
    _S.TRANSIENT: frozenset({_S.HEALTHY}),
    _S.PERSISTENT: frozenset({_S.HEALTHY}),
    _S.GENUINE: frozenset({_S.HEALTHY, _S.STOPPED}),
    _S.STOPPED: frozenset(),
}
_ABORTABLE = frozenset({_S.RERUN_IN_PLACE, _S.RERUN_ON_PEER, _S.DETERMINISM_CHECK, _S.TRANSIENT, _S.PERSISTENT,
                        _S.GENUINE})

_KEEP_DECISIONS = 64


class IllegalRerunTransition(RuntimeError):
    pass


class RerunMachine:
    """One rank's machine: its state, its validators, and the record of decisions.

    ``state_dict()`` is plain JSON in two parts: ``validators`` (the running
    histories, which belong to a step boundary and roll back with it) and
    ``record`` (counters, suspect ranks, recent decisions: the run's memory,
    which never rolls back).
    """

    def __init__(self, validators: ValidatorSet | None = None) -> None:
        self.state = RerunState.HEALTHY
        self.validators = validators or ValidatorSet()
        self.counters: dict[str, int] = {
            "steps_validated": 0, "rejected": 0, "reruns": 0, "peer_reruns": 0,
            "transient": 0, "persistent": 0, "genuine": 0, "skipped": 0,
            "determinism_checks": 0, "determinism_mismatches": 0,
        }
        self.suspects: list[int] = []  # ranks classified persistent, oldest first
        self.version = 0  # grows with every change of the record: a newer record is never replaced by an older one
        self.decisions: deque[dict[str, Any]] = deque(maxlen=_KEEP_DECISIONS)

    def to(self, new: RerunState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalRerunTransition(f"rerun: {self.state.value} -> {new.value} is not allowed")
        self.state = new

    def abort(self) -> None:
        """A fault of the run interrupted the flow: back to HEALTHY (a no-op when already there)."""
        if self.state in _ABORTABLE:
            self.state = RerunState.HEALTHY

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
        self.version += 1

    def classify(self, classification: Classification, record: dict[str, Any]) -> None:
        """Remembers one suspect's classification (the driver moves the state once per step)."""
        self.count(classification.value)
        if classification is Classification.PERSISTENT and record.get("rank") not in self.suspects:
            self.suspects.append(int(record["rank"]))
        self.decisions.append({"classification": classification.value, **record})

    # ------------------------------------------------------------- state
    def record_dict(self) -> dict[str, Any]:
        return {"version": self.version, "counters": dict(self.counters), "suspects": list(self.suspects),
                "decisions": list(self.decisions)}

    def load_record(self, rec: dict[str, Any]) -> None:
        """Takes ``rec`` unless this machine's own record is as new or newer."""
        if int(rec.get("version", 0)) <= self.version:
            return
        self.version = int(rec["version"])
        self.counters.update({str(k): int(v) for k, v in rec.get("counters", {}).items()})
        self.suspects = [int(r) for r in rec.get("suspects", [])]
        self.decisions.clear()
        self.decisions.extend(rec.get("decisions", []))

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "validators": self.validators.state_dict(), "record": self.record_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restores the validators (they belong to the step boundary) and the record when it is newer.

        A survivor rolled back to an older step keeps its own, newer record; a
        replacement or a job restarted from disk takes the saved one. The flow
        state is not restored: a snapshot is taken where the flow is over.
        """
        self.validators.load_state_dict(sd["validators"])
        self.load_record(sd["record"])
