"""Validators of one step's results: NaN/Inf, loss spikes, gradient-norm spikes, user checks.

Usable on their own (plain Python, no torch and no ``resilient_train``
imports)::

    checks = ValidatorSet(loss_spike_factor=10.0)
    verdict = checks.check(StepResult(loss=2.3, grad_norm=0.8))
    if verdict.accepted:
        checks.commit(result)        # only accepted results enter the running history

A check never changes the history by itself: the caller commits a result once
every rank agrees to keep it, so a rejected step (or a re-run that is thrown
away) leaves no trace. ``state_dict`` is plain JSON.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["Check", "RunningHistory", "StepResult", "ValidatorSet", "Verdict"]


@dataclass(frozen=True)
class StepResult:
    """What one rank's step produced: its local loss and its local (pre-all-reduce) gradient norm."""

    loss: float
    grad_norm: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return {"loss": _plain(self.loss), "grad_norm": _plain(self.grad_norm)}


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str = ""  # "nan_loss", "loss_spike", "nan_grad_norm", "grad_norm_spike", or a user check's name
    value: float | None = None  # the value that was judged
    limit: float | None = None  # the threshold it crossed, when there is one

    def as_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "reason": self.reason, "value": _plain(self.value), "limit": _plain(self.limit)}


# A user check returns None to accept, or a short reason to reject.
Check = Callable[[StepResult], "str | None"]

ACCEPT = Verdict(True)


class RunningHistory:
    """The last ``window`` accepted values; a spike is a value above ``factor`` x their mean."""

    def __init__(self, *, window: int, min_history: int, factor: float) -> None:
        if window < 1:
            raise ValueError(f"history window must be >= 1, got {window}")
        if not 1 <= min_history <= window:
            raise ValueError(f"min_history must be in [1, window={window}], got {min_history}")
        if not factor > 1.0:
            raise ValueError(f"spike factor must be > 1, got {factor}")
        self.factor = factor
        self.min_history = min_history
        self.values: deque[float] = deque(maxlen=window)

    def limit(self) -> float | None:
        """The largest value accepted now, or None while the history is too short to judge."""
        if len(self.values) < self.min_history:
            return None
        mean = math.fsum(self.values) / len(self.values)
        if mean <= 0.0:
            return None  # a spike factor means nothing for a non-positive scale
        return self.factor * mean

    def add(self, value: float) -> None:
        self.values.append(float(value))

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in sd["values"])


class ValidatorSet:
    """The standard checks plus the user's, applied in order; the first rejection wins."""

    def __init__(
        self,
        *,
        loss_spike_factor: float | None = 10.0,
        grad_norm_spike_factor: float | None = 10.0,
        window: int = 50,
        min_history: int = 5,
        checks: Iterable[Check] = (),
    ) -> None:
        self.loss_history = (
            RunningHistory(window=window, min_history=min_history, factor=loss_spike_factor)
            if loss_spike_factor is not None else None
        )
        self.grad_history = (
            RunningHistory(window=window, min_history=min_history, factor=grad_norm_spike_factor)
            if grad_norm_spike_factor is not None else None
        )
        self.checks = list(checks)

    def check(self, result: StepResult) -> Verdict:
        if not math.isfinite(result.loss):
            return Verdict(False, "nan_loss", result.loss)
        if result.grad_norm is not None and not math.isfinite(result.grad_norm):
            return Verdict(False, "nan_grad_norm", result.grad_norm)
        v = _spike(self.loss_history, result.loss, "loss_spike")
        if v is not None:
            return v
        if result.grad_norm is not None:
            v = _spike(self.grad_history, result.grad_norm, "grad_norm_spike")
            if v is not None:
                return v
        for check in self.checks:
            reason = check(result)
            if reason:
                return Verdict(False, str(reason))
        return ACCEPT

    def commit(self, result: StepResult) -> None:
        """Adds an accepted result to the running histories."""
        if self.loss_history is not None:
            self.loss_history.add(result.loss)
        if self.grad_history is not None and result.grad_norm is not None:
            self.grad_history.add(result.grad_norm)

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss_history.state_dict() if self.loss_history is not None else None,
            "grad_norm": self.grad_history.state_dict() if self.grad_history is not None else None,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for hist, key in ((self.loss_history, "loss"), (self.grad_history, "grad_norm")):
            if hist is not None and sd.get(key) is not None:
                hist.load_state_dict(sd[key])


def _spike(history: RunningHistory | None, value: float, reason: str) -> Verdict | None:
    if history is None:
        return None
    limit = history.limit()
    if limit is not None and value > limit:
        return Verdict(False, reason, value, limit)
    return None


def _plain(x: float | None) -> float | str | None:
    """JSON has no NaN or Inf: those become strings."""
    if x is None or math.isfinite(x):
        return x
    return repr(float(x))
