"""Rerun configuration and the pure decision rules every rank applies to the same shared values.

Modes and exit codes follow Megatron-Core's rerun state machine:

* ``disabled``: nothing is checked.
* ``validate_results``: every step's loss and gradient norm are validated; a
  rejection starts the re-run flow (see :mod:`resilient_train.rank.rerun.machine`).
* ``report_determinism_stats``: every ``determinism_interval``-th step is
  re-run in place and compared bit for bit; the result is reported, nothing
  is acted on.

Exit codes: :data:`EXIT_RERUN_ELSEWHERE` (16) is the exit of a rank found
persistently faulty (its state is held by its peers and the store; its work
is re-run elsewhere: the agent replaces it). :data:`EXIT_VALIDATION_FAILED`
(17) is every rank's exit when the policy stops the job on a genuine event,
after the last good state was saved.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

from resilient_train.base import exitcodes
from resilient_train.rank.rerun.validators import Check, StepResult, ValidatorSet

__all__ = [
    "EXIT_RERUN_ELSEWHERE",
    "EXIT_VALIDATION_FAILED",
    "OnGenuine",
    "RerunConfig",
    "RerunMode",
    "peer_for",
    "same_result",
    "swap_assignment",
]

EXIT_RERUN_ELSEWHERE = exitcodes.RERUN_ELSEWHERE
EXIT_VALIDATION_FAILED = exitcodes.VALIDATION_FAILED


class RerunMode(str, Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class OnGenuine(str, Enum):
    SKIP = "skip"  # drop the step's update, move past its batch, continue
    STOP = "stop"  # save the last good state, report, exit 17


@dataclass(kw_only=True)
class RerunConfig:
    mode: RerunMode = RerunMode.DISABLED  # validate_results: check every step; report_determinism_stats: re-run some
    loss_spike_factor: float | None = 10.0  # a loss this many times its history's is a spike (Megatron's); None: off
    grad_norm_spike_factor: float | None = 10.0  # the same for the gradient norm
    window: int = 50  # accepted steps in the running history
    min_history: int = 5  # steps before a spike can be judged
    on_genuine: OnGenuine = OnGenuine.SKIP  # a genuine numerical event: skip the batch, or save and stop (exit 17)
    determinism_interval: int = 1  # report_determinism_stats: re-run every N-th step
    stop_timeout_s: float = 120.0  # how long ranks wait for the saved state before exiting 17
    checks: list[Check] = field(default_factory=list)  # user checks: StepResult -> None or a reason

    def __post_init__(self) -> None:
        self.mode = RerunMode(self.mode)
        self.on_genuine = OnGenuine(self.on_genuine)
        if self.determinism_interval < 1:
            raise ValueError(f"determinism_interval must be >= 1, got {self.determinism_interval}")
        for name in ("loss_spike_factor", "grad_norm_spike_factor"):
            v = getattr(self, name)
            if v is not None and not v > 1.0:
                raise ValueError(f"{name} must be > 1 or None, got {v}")

    @property
    def enabled(self) -> bool:
        return self.mode is not RerunMode.DISABLED

    def validators(self) -> ValidatorSet:
        return ValidatorSet(
            loss_spike_factor=self.loss_spike_factor, grad_norm_spike_factor=self.grad_norm_spike_factor,
            window=self.window, min_history=self.min_history, checks=self.checks,
        )


def _bits(x: float | None) -> bytes | None:
    if x is None:
        return None
    if math.isnan(x):
        return b"nan"  # NaN payloads are not a result
    return struct.pack("<d", x)


def same_result(a: StepResult, b: StepResult) -> bool:
    """Bit for bit (any NaN equals any NaN; 0.0 differs from -0.0)."""
    return _bits(a.loss) == _bits(b.loss) and _bits(a.grad_norm) == _bits(b.grad_norm)


def peer_for(suspect: int, suspects: Iterable[int], world_size: int) -> int | None:
    """The healthy rank that recomputes ``suspect``'s batch: the next rank up (cyclically) not under suspicion."""
    bad = set(suspects)
    for k in range(1, world_size):
        r = (suspect + k) % world_size
        if r not in bad:
            return r
    return None


def swap_assignment(world_size: int, suspect: int, peer: int) -> list[int]:
    """``as_rank[r]``: whose computation rank ``r`` performs in a peer round (the pair swaps, the rest keep theirs)."""
    assign = list(range(world_size))
    assign[suspect], assign[peer] = peer, suspect
    return assign
