"""Faults as data: what goes wrong, where, and when."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Iterable

__all__ = ["RECOVERY_PHASES", "VALUE_KINDS", "Fault", "FaultKind", "Phase", "dumps_faults", "loads_faults"]


class FaultKind(str, Enum):
    KILL = "kill"  # SIGKILL of the rank's process
    RAISE = "raise"  # an exception inside the step
    HANG = "hang"  # SIGSTOP of the rank's process (the agent's hang detection must catch it)
    SPIN = "spin"  # the main thread spins in C code holding the GIL (no other thread runs)
    BLOCK = "block"  # the main thread blocks forever while its other threads run (e.g. data loading)
    SLOW = "slow"  # the rank is slowed down for duration_s (a straggler): each entry to the phase sleeps
    TERM = "term"  # SIGTERM of the rank's process (preemption of one rank)
    NETBREAK = "netbreak"  # the rank's process-group connections are shut down (not the store's)
    # Value faults (chaos.values): wrong numbers, for the rerun state machine.
    NAN = "nan"  # the rank's loss is NaN once (transient)
    BITFLIP = "bitflip"  # a bit flips in the rank's gradient every step from `step`, in that process only (persistent)
    SPIKE = "spike"  # the batch of (step, rank) makes the loss spike wherever it is computed (genuine)


VALUE_KINDS = frozenset({FaultKind.NAN, FaultKind.BITFLIP, FaultKind.SPIKE})  # applied by chaos.values, not at a phase


class Phase(str, Enum):
    """The named points the supervisor reports inside and around a step."""

    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    ALL_REDUCE = "all-reduce"
    OPTIMIZER = "optimizer"
    BETWEEN_STEPS = "between-steps"
    HEAL = "heal"  # a replacement copying state from a peer during recovery
    RENDEZVOUS = "rendezvous"  # every rank joined a generation and builds its process group


# Phases of a recovery, not of a step: their faults fire at a generation change (``step``: the resume step).
RECOVERY_PHASES = frozenset({Phase.HEAL, Phase.RENDEZVOUS})


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault. ``step`` None means the first time the phase is reached at all.

    ``not_before`` (seconds since the epoch) holds the fault back until then: a
    fault pinned to a wall-clock offset fires at the first matching phase after
    it. ``duration_s`` is how long a lasting fault (``slow``) lasts.
    """

    kind: FaultKind
    rank: int
    phase: Phase
    step: int | None = None
    not_before: float | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FaultKind(self.kind))
        object.__setattr__(self, "phase", Phase(self.phase))
        if self.rank < 0:
            raise ValueError(f"fault rank must be >= 0, got {self.rank}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"], d["phase"] = self.kind.value, self.phase.value
        return d


def dumps_faults(faults: Iterable[Fault]) -> str:
    return json.dumps([f.to_dict() for f in faults])


def loads_faults(text: str) -> list[Fault]:
    data = json.loads(text) if text else []
    if not isinstance(data, list):
        raise ValueError("faults must be a JSON list")
    return [Fault(**d) for d in data]
