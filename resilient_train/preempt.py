"""Preemption: a signal becomes a checkpoint at a step boundary every rank agrees on.

A scheduler that takes the nodes back sends SIGTERM (Slurm's ``--signal``
sends SIGUSR1 ahead of time) to the agents, or to the ranks themselves. A rank
that sees one only raises its stop flag, which rides with the commit vote of
the step under way (resilient_train.reducer: a second summed slot). Every rank
reads the same sum after the same step, so all of them stop at the same
boundary: a synchronous committed checkpoint of that boundary is written, and
each rank exits with :data:`~resilient_train.exitcodes.REQUEUE`; the agents
exit with it too. Started again, the job resumes from that checkpoint and
loses no step.

The grace (``grace_s``) is counted from the signal, or from the step whose vote
told this rank, to the rank's exit: the save in flight, the preemption's own
save and the exit all fit in it, and the agents SIGKILL what is left at its end
(resilient_train.shutdown: the ranks publish it, the agents follow it). Unset,
it is :data:`~resilient_train.shutdown.DEFAULT_GRACE_S`, grown to cover three
times the longest save the job has made (two saves and slack). If the checkpoint is not committed in time
the rank exits with the same code anyway (the job then resumes from its
previous checkpoint); ``on_grace_expiry="wait"`` gives the save the
checkpoint's own ``timeout_s`` more, for schedulers whose grace is known to be
longer.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from resilient_train.shutdown import EXIT_RESERVE_S, auto_grace, check_seconds

__all__ = ["Preemption", "PreemptionConfig"]

_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP")
# SIGUSR2 is the agent's request for a hung rank's stacks (monitors.stacks): a preemption on it would turn
# every hang report into a stop of the job.
_RESERVED = {"SIGUSR2": "the agent asks a hung rank for its stacks with it (monitors.stacks)"}


@dataclass(frozen=True, kw_only=True)
class PreemptionConfig:
    # Each one asks for a stop at the next boundary; SIGINT too: Ctrl-C stops the job cleanly, checkpointed.
    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")
    grace_s: float | None = None  # seconds from the signal to the rank's exit; None: the default (above)
    on_grace_expiry: str = "exit"  # "exit": leave without it; "wait": keep waiting for the save

    def __post_init__(self) -> None:
        reserved = [s for s in self.signals if s in _RESERVED]
        if reserved:
            raise ValueError(f"preemption.signals: {reserved[0]} cannot preempt: {_RESERVED[reserved[0]]}")
        bad = [s for s in self.signals if s not in _SIGNALS]
        if bad:
            raise ValueError(f"preemption.signals: unknown signal {bad[0]!r} (one of {', '.join(_SIGNALS)})")
        if self.grace_s is not None:
            check_seconds(self.grace_s, "preemption.grace_s")
            if self.grace_s <= EXIT_RESERVE_S:
                raise ValueError(f"preemption.grace_s must be more than {EXIT_RESERVE_S:g} s (a rank's exit), "
                                 f"got {self.grace_s!r}")
        if self.on_grace_expiry not in ("exit", "wait"):
            raise ValueError(f"preemption.on_grace_expiry must be 'exit' or 'wait', got {self.on_grace_expiry!r}")


class Preemption:
    """This rank's stop flag: raised by a signal (or by :meth:`request`), read into the vote."""

    def __init__(self, config: PreemptionConfig) -> None:
        self.config = config
        self.signal: str | None = None  # the first one received
        self.requested_at: float | None = None  # when (monotonic)
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for name in config.signals:
                signum = getattr(signal, name)
                self._previous[signum] = signal.signal(signum, self._on_signal)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def request(self, why: str) -> None:
        if self.signal is None:
            self.requested_at = time.monotonic()
            self.signal = why

    def grace_s(self, longest_save_s: float, checkpoint_timeout_s: float) -> float:
        """This rank's grace now, from the signal to its exit (what it publishes for its agent)."""
        grace = self.config.grace_s if self.config.grace_s is not None else auto_grace(longest_save_s)
        return grace + (checkpoint_timeout_s if self.config.on_grace_expiry == "wait" else 0.0)

    def deadline(self, grace_s: float) -> float:
        """When the checkpoint must be committed by (monotonic): the grace from the signal, less the exit's share.

        A rank told by the vote (the signal reached another rank) counts from now."""
        start = self.requested_at if self.requested_at is not None else time.monotonic()
        return start + grace_s - EXIT_RESERVE_S

    def flag(self) -> float:
        """The stop slot of this rank's vote."""
        return 1.0 if self.signal is not None else 0.0

    def _on_signal(self, signum: int, frame: object) -> None:
        self.request(signal.Signals(signum).name)

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
