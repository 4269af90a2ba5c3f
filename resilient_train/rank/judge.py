"""The verdict on a failure: recover it, or stop the job (a bug, a misuse, a full disk, no progress).

One rank's view, fed every failure it sees and every step it completes:

* a collective or store error, or a generation another party declared failed,
  is a fault: recover;
* an exception is recovered once; raised again by this rank (same type,
  message without its numbers, and place), it is a bug: stop, with the first
  traceback. Again on the step's replay, or again later (an exception after
  the commit, where logging and metrics code lives, recurs every N steps and
  never on a replay): either way at most one retry. A collective or store
  error is a fault however often it comes;
* a misuse of the runtime, a full disk, a world that never assembles: stop;
* more than ``max_recoveries`` recoveries, or more than
  ``max_failed_generations`` generations in a row without a completed step:
  stop, naming the last failure.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from checkpointing.errors import storage_stop
from resilient_train.base import exitcodes
from resilient_train.rank.errors import Failure, FailureKind, UsageError, WrongInput, classify

__all__ = ["Judge", "Stop"]

_REMEMBERED = 64  # distinct exceptions a rank remembers (each recovered once so far)


@dataclass(frozen=True, kw_only=True)
class Stop:
    """The job stops: ``reason`` is its one line; ``traceback`` is printed once (empty: none)."""

    reason: str
    exit_code: int = exitcodes.STOPPED
    traceback: str = ""


class Judge:
    def __init__(self, *, max_recoveries: int, max_failed_generations: int) -> None:
        self.max_recoveries = max_recoveries
        self.max_failed_generations = max_failed_generations
        self.recoveries = 0
        self.without_progress = 0  # generations in a row that completed no step
        self._exceptions: dict[str, tuple[int, str]] = {}  # signature -> (the step it was first raised at, traceback)

    def progress(self) -> None:
        """A step completed."""
        self.without_progress = 0

    def failure(self, exc: BaseException, *, step: int, generation_moved: bool) -> Failure | Stop:
        """The failure to recover from, or why the job stops."""
        from resilient_train.rank.generation import JoinError  # noqa: PLC0415  (generation imports this package's errors)

        if isinstance(exc, JoinError):
            return Stop(reason=str(exc), exit_code=exitcodes.FAILED, traceback=_text(exc))
        storage = storage_stop(exc)
        if storage is not None:  # every replacement would fail the same write
            return Stop(reason=str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__, exit_code=storage)
        failure = classify(exc)
        if failure.kind is FailureKind.USAGE:
            return Stop(reason=str(exc), traceback="" if isinstance(exc, UsageError) else _text(exc),
                        exit_code=exitcodes.BAD_INPUT if isinstance(exc, WrongInput) else exitcodes.STOPPED)
        # An exception raised while the generation was already failing is a consequence, never a verdict.
        if failure.kind is FailureKind.EXCEPTION and not generation_moved and not getattr(exc, "injected", False):
            seen = self._exceptions.get(failure.signature)
            if seen is not None:
                first, text = seen
                again = f"when step {step} was replayed" if first == step else f"at step {step}, as at step {first}"
                return Stop(reason=f"{failure.summary} (raised again {again}: a bug, not a fault)", traceback=text)
            if len(self._exceptions) >= _REMEMBERED:
                self._exceptions.pop(next(iter(self._exceptions)))
            self._exceptions[failure.signature] = (step, _text(exc))
        return failure

    def not_recovering(self) -> None:
        """The last recovery counted was none: the wake behind it was a stop's (found when the rank joined)."""
        self.recoveries -= 1
        self.without_progress -= 1

    def recovering(self, failure: Failure) -> Stop | None:
        """Counts a recovery; a stop when a budget is spent."""
        self.recoveries += 1
        self.without_progress += 1
        if self.recoveries > self.max_recoveries:
            return Stop(reason=f"gave up after {self.max_recoveries} recoveries (last: {failure.summary})",
                        exit_code=exitcodes.FAILED)
        if self.without_progress > self.max_failed_generations:
            return Stop(reason=f"{self.without_progress} generations in a row failed without completing a step "
                               f"(last: {failure.summary})")
        return None


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))
