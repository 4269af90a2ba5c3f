"""Faults as data: what goes wrong, where, and when."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any, Iterable

__all__ = [
    "MAX_CHAOS_BYTES", "MAX_DURATION_S", "MAX_EPOCH_S", "MAX_FAULTS", "MAX_STEP", "RECOVERY_PHASES", "VALUE_KINDS", "Fault", "FaultKind", "Phase", "dumps_faults", "loads_faults",
    "parse_faults", "validate_faults",
]

# Faults reach every worker in one environment variable (RT_CHAOS), and Linux caps one environment
# string at 128 KiB (MAX_ARG_STRLEN): past it every spawn fails with E2BIG. A fault is about 100 bytes.
MAX_CHAOS_BYTES = 100_000
MAX_FAULTS = 1000
# Numbers a fault may hold: a lasting fault outlives no scenario (a week, chaos.scenario.MAX_TIMEOUT_S),
# a step fits the int64 a checkpoint keeps it in, a wall-clock time is before the year 10000.
MAX_DURATION_S = 7 * 24 * 3600.0
MAX_STEP = 2**63 - 1
MAX_EPOCH_S = 253402300799.0


class FaultKind(str, Enum):
    KILL = "kill"  # SIGKILL of the rank's process
    RAISE = "raise"  # an exception inside the step
    HANG = "hang"  # SIGSTOP of the rank's process (the agent's hang detection must catch it)
    SPIN = "spin"  # the main thread spins in C code holding the GIL (no other thread runs)
    BLOCK = "block"  # the main thread blocks forever while its other threads run (e.g. data loading)
    DEADLOCK = "deadlock"  # the main thread waits on an event no thread will set (a deadlock, a queue never fed)
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
        object.__setattr__(self, "kind", _member(FaultKind, self.kind, "kind"))
        object.__setattr__(self, "phase", _member(Phase, self.phase, "phase"))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {self.rank!r}")
        if self.step is not None and (isinstance(self.step, bool) or not isinstance(self.step, int)
                                      or not 0 <= self.step <= MAX_STEP):
            raise ValueError(f"step must be an integer in [0, {MAX_STEP}] or null, got {self.step!r}")
        for name, high in (("not_before", MAX_EPOCH_S), ("duration_s", MAX_DURATION_S)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0 or (name == "duration_s" and v == 0) or v > high):
                raise ValueError(f"{name} must be a finite number {'> 0' if name == 'duration_s' else '>= 0'} "
                                 f"and at most {high:g}, or null, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"], d["phase"] = self.kind.value, self.phase.value
        return d


def dumps_faults(faults: Iterable[Fault]) -> str:
    return json.dumps([f.to_dict() for f in faults])


def loads_faults(text: str) -> list[Fault]:
    """The faults of a JSON list (``dumps_faults``); ``ValueError`` with a one-line reason otherwise."""
    if len(text) > MAX_CHAOS_BYTES:
        raise ValueError(f"{len(text)} bytes of faults; at most {MAX_CHAOS_BYTES} (they travel to every worker in "
                         "one environment variable, which Linux caps at 128 KiB)")
    try:
        data = json.loads(text) if text.strip() else []
    except RecursionError:
        raise ValueError("not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"faults must be a JSON list of objects, got {type(data).__name__}")
    if len(data) > MAX_FAULTS:
        raise ValueError(f"{len(data)} faults; at most {MAX_FAULTS} (they travel to every worker in one "
                         "environment variable, which Linux caps at 128 KiB)")
    known = {f.name for f in fields(Fault)}
    out = []
    for i, d in enumerate(data):
        if not isinstance(d, dict):
            raise ValueError(f"fault {i}: must be an object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"fault {i}: unknown field(s) {unknown}; expected some of {sorted(known)}")
        missing = [k for k in ("kind", "rank", "phase") if k not in d]
        if missing:
            raise ValueError(f"fault {i}: missing {', '.join(missing)}")
        try:
            out.append(Fault(**d))
        except ValueError as e:
            raise ValueError(f"fault {i}: {e}") from None
    return out


def validate_faults(faults: list[Fault], world_size: int) -> None:
    """Faults a job of ``world_size`` ranks can fire: every rank exists, and the list fits in a worker's
    environment. ``ValueError`` naming the first one that does not."""
    if len(faults) > MAX_FAULTS:
        raise ValueError(f"{len(faults)} faults; at most {MAX_FAULTS} (they travel to every worker in one "
                         "environment variable, which Linux caps at 128 KiB)")
    for i, f in enumerate(faults):
        if f.rank >= world_size:
            raise ValueError(f"fault {i} ({f.kind.value} at {f.phase.value}): rank {f.rank} does not exist in a job "
                             f"of {world_size} rank(s)")
    size = len(dumps_faults(faults))
    if size > MAX_CHAOS_BYTES:
        raise ValueError(f"the faults take {size} bytes; at most {MAX_CHAOS_BYTES} fit in a worker's environment")


def parse_faults(text: str, world_size: int) -> list[Fault]:
    """``loads_faults`` then ``validate_faults``: what ``run --chaos`` checks before any worker starts."""
    faults = loads_faults(text)
    validate_faults(faults, world_size)
    return faults


def _member(enum: type[Enum], value: Any, what: str) -> Any:
    try:
        return enum(value)
    except (ValueError, TypeError):
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(m.value for m in enum)}") from None
