"""Schedules: which faults a scenario fires, and when. Fixed lists or random draws with a seed.

A :class:`PlannedFault` is what a scenario file says: a kind, the target ranks,
and a trigger (a step and a phase, or a wall-clock offset from the launch of
the job). In-rank kinds become :class:`chaos.faults.Fault` records for the
runtime's injector; *driver* kinds (``store-outage``, ``corrupt-ckpt``) are
fired from outside the job by the chaos runner.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from chaos.faults import MAX_DURATION_S, MAX_FAULTS, RECOVERY_PHASES, Fault, FaultKind, Phase
from resilient_train.base.configfile import require_int, require_number

__all__ = [
    "DRIVER_KINDS",
    "FixedSchedule",
    "MAX_SEED",
    "MAX_STEPS",
    "PlannedFault",
    "RandomSchedule",
    "Schedule",
    "STEP_PHASES",
    "TOLERATED_KINDS",
    "all_kinds",
]

STORE_OUTAGE = "store-outage"  # the agent (which hosts the store) is SIGSTOPped for duration_s
CORRUPT_CKPT = "corrupt-ckpt"  # a byte of the newest committed checkpoint's largest file is flipped
DRIVER_KINDS: tuple[str, ...] = (STORE_OUTAGE, CORRUPT_CKPT)
# Kinds the runtime rides through without a recovery: no detection is required of them.
TOLERATED_KINDS: frozenset[str] = frozenset({"slow", STORE_OUTAGE})
STEP_PHASES: tuple[str, ...] = tuple(p.value for p in Phase if p not in RECOVERY_PHASES)
MAX_SEED = 2**64 - 1  # seeds are in [0, MAX_SEED]
MAX_STEPS = 10**9  # a scenario is a test: steps, gaps and step offsets stay below this


def all_kinds() -> tuple[str, ...]:
    """Every fault kind this installation knows: the runtime's in-rank kinds, then the driver's."""
    return tuple(k.value for k in FaultKind) + DRIVER_KINDS


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    kind: str
    ranks: tuple[int, ...] = (0,)
    phase: str | None = None  # required for in-rank kinds
    step: int | None = None  # None with at_s None: the first time the phase is reached
    at_s: float | None = None  # seconds after the job's launch
    duration_s: float | None = None
    detect_timeout_s: float | None = None  # this fault's own limits (default: the scenario's invariants)
    recover_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in all_kinds():
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {', '.join(all_kinds())}")
        if not isinstance(self.ranks, tuple) or not self.ranks or any(
                isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.ranks):
            raise ValueError(f"fault {self.kind!r}: ranks must be non-negative integers, got {self.ranks!r}")
        if self.phase is not None and not isinstance(self.phase, str):
            _bad_phase(self.phase)
        if any(r > MAX_STEPS for r in self.ranks):
            raise ValueError(f"fault {self.kind!r}: rank {max(self.ranks)} is past any job's ranks")
        if self.step is not None:
            require_int(self.step, f"fault {self.kind!r}: step", high=MAX_STEPS)
        for name in ("at_s", "duration_s", "detect_timeout_s", "recover_timeout_s"):
            if getattr(self, name) is not None:
                require_number(getattr(self, name), f"fault {self.kind!r}: {name}", high=MAX_DURATION_S)
        for name in ("detect_timeout_s", "recover_timeout_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"fault {self.kind!r}: {name} must be > 0, got {getattr(self, name)}")
        if self.driver:
            if self.step is None and self.at_s is None:
                raise ValueError(f"fault {self.kind!r} is fired by the runner: give it a step or an at_s")
        else:
            if self.phase is None:
                raise ValueError(f"fault {self.kind!r}: a phase is required ({', '.join(p.value for p in Phase)})")
            if self.phase not in {p.value for p in Phase}:
                _bad_phase(self.phase)
        if self.step is not None and self.step < 0:
            raise ValueError(f"fault {self.kind!r}: step must be >= 0, got {self.step}")
        if self.at_s is not None and self.at_s < 0:
            raise ValueError(f"fault {self.kind!r}: at_s must be >= 0, got {self.at_s}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"fault {self.kind!r}: duration_s must be > 0, got {self.duration_s}")

    @property
    def driver(self) -> bool:
        return self.kind in DRIVER_KINDS

    @property
    def tolerated(self) -> bool:
        return self.kind in TOLERATED_KINDS

    def label(self) -> str:
        where = f"step {self.step}" if self.step is not None else (f"t+{self.at_s:g}s" if self.at_s is not None else "first")
        if self.driver:
            return f"{self.kind} {where}"
        return f"{self.kind} rank {','.join(map(str, self.ranks))} {self.phase} {where}"

    def to_faults(self, *, launch_time: float) -> list[Fault]:
        """The runtime's records (one per rank); empty for driver kinds."""
        if self.driver:
            return []
        not_before = launch_time + self.at_s if self.at_s is not None else None
        return [
            Fault(kind=FaultKind(self.kind), rank=r, phase=Phase(self.phase), step=self.step,
                  not_before=not_before, duration_s=self.duration_s)
            for r in self.ranks
        ]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "ranks": list(self.ranks)}
        for name in ("phase", "step", "at_s", "duration_s", "detect_timeout_s", "recover_timeout_s"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d


def _bad_phase(phase: str) -> None:
    raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(p.value for p in Phase)}")


@dataclass(frozen=True, kw_only=True)
class FixedSchedule:
    faults: tuple[PlannedFault, ...] = ()

    def plan(self, *, world_size: int, steps: int) -> list[PlannedFault]:
        for f in self.faults:
            if max(f.ranks) >= world_size:
                raise ValueError(f"fault {f.label()}: rank out of range for {world_size} ranks")
            if f.step is not None and f.step >= max(steps, 1) and not f.driver:
                raise ValueError(f"fault {f.label()}: step {f.step} is never reached by a {steps}-step job")
        return list(self.faults)


@dataclass(frozen=True, kw_only=True)
class RandomSchedule:
    """``count`` faults with exponential gaps (mean ``mtbf_steps`` steps, or ``mtbf_s`` seconds), from ``seed``.

    The same seed and job give the same list, fault for fault. Step-pinned gaps
    make a run reproducible too; wall-clock gaps fire at the first matching
    phase after the offset, wherever the run then is.

    ``min_gap_steps`` keeps step-pinned faults that many steps apart. Two faults
    a step apart race: ranks a step ahead of a faulted peer can reach the
    second fault's phase while the first is being detected, and whichever the
    run sees first ends the step in which the other would have fired (a fault
    between steps ``s`` and ``s+1`` is never reached again once the run resumes
    past ``s``). Two steps apart, the step's all-reduce holds every rank back
    until the first fault is recovered: a scenario that needs every fault to
    fire (``invariants.min_faults`` = ``count``) sets ``min_gap_steps: 2``.
    """

    seed: int
    count: int
    mtbf_steps: float | None = None
    mtbf_s: float | None = None
    start: float = 0.0  # the first gap is counted from here (a step, or seconds after launch)
    kinds: tuple[str, ...] = ("kill", "raise")
    phases: tuple[str, ...] = STEP_PHASES
    duration_s: float | None = None  # for lasting kinds (slow, store-outage)
    ranks: tuple[int, ...] | None = None  # targets to draw from (default: every rank)
    min_gap_steps: int = 0  # step-pinned faults at least this many steps apart (see above)

    def __post_init__(self) -> None:
        require_int(self.seed, "random schedule: seed", low=0, high=MAX_SEED)
        require_int(self.min_gap_steps, "random schedule: min_gap_steps", low=0, high=MAX_STEPS)
        if self.min_gap_steps and self.mtbf_s is not None:
            raise ValueError("random schedule: min_gap_steps applies to mtbf_steps (faults pinned to steps), "
                             "not to mtbf_s")
        if (self.mtbf_steps is None) == (self.mtbf_s is None):
            raise ValueError("random schedule: give exactly one of mtbf_steps and mtbf_s")
        mean = self.mtbf_steps if self.mtbf_steps is not None else self.mtbf_s
        require_number(mean, "random schedule: the mean time between faults (mtbf_steps or mtbf_s)", above=0,
                       high=MAX_STEPS if self.mtbf_steps is not None else MAX_DURATION_S)
        require_int(self.count, "random schedule: count", low=1)
        if self.count > MAX_FAULTS:
            raise ValueError(f"random schedule: count {self.count}; at most {MAX_FAULTS} (faults travel to every "
                             "worker in one environment variable, which Linux caps at 128 KiB)")
        require_number(self.start, "random schedule: start", low=0,
                       high=MAX_STEPS if self.mtbf_steps is not None else MAX_DURATION_S)
        if self.duration_s is not None:
            require_number(self.duration_s, "random schedule: duration_s", above=0, high=MAX_DURATION_S)
        if not isinstance(self.kinds, tuple) or not isinstance(self.phases, tuple):
            raise ValueError("random schedule: kinds and phases must be lists")
        for k in self.kinds:
            PlannedFault(kind=k, phase=STEP_PHASES[0], step=0)  # validates the kind
        if not self.kinds or not self.phases:
            raise ValueError("random schedule: kinds and phases must not be empty")
        for p in self.phases:
            if not isinstance(p, str) or p not in {ph.value for ph in Phase}:
                _bad_phase(p)
        if self.ranks is not None and (not isinstance(self.ranks, tuple) or any(
                isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.ranks)):
            raise ValueError(f"random schedule: ranks must be a list of non-negative integers, got {self.ranks!r}")

    def plan(self, *, world_size: int, steps: int) -> list[PlannedFault]:
        rng = random.Random(self.seed)
        targets = self.ranks if self.ranks is not None else tuple(range(world_size))
        if not targets or max(targets) >= world_size:
            raise ValueError(f"random schedule: ranks {targets} do not fit {world_size} ranks")
        out: list[PlannedFault] = []
        t = self.start
        mean = self.mtbf_steps or self.mtbf_s
        assert mean is not None
        last: int | None = None
        for _ in range(self.count):
            t += rng.expovariate(1.0 / mean)
            if self.min_gap_steps and last is not None and int(t) < last + self.min_gap_steps:
                t = float(last + self.min_gap_steps)
            kind, rank, phase = rng.choice(self.kinds), rng.choice(targets), rng.choice(self.phases)
            when: dict[str, Any] = {"at_s": round(t, 3)} if self.mtbf_s else {"step": int(t)}
            last = int(t)
            if "step" in when and when["step"] >= steps:
                raise ValueError(
                    f"random schedule: fault {len(out) + 1} of {self.count} falls at step {when['step']}, "
                    f"past the job's {steps} steps; lengthen the job or lower count/mtbf_steps"
                )
            duration = self.duration_s if kind in TOLERATED_KINDS else None
            out.append(PlannedFault(kind=kind, ranks=(rank,), phase=phase, duration_s=duration, **when))
        return out


Schedule = FixedSchedule | RandomSchedule
