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

If the checkpoint is not committed within ``grace_s`` the rank exits with the
same code anyway (the job then resumes from its previous checkpoint);
``PreemptionConfig(on_grace_expiry="wait")`` waits for the save instead, for
schedulers whose grace is known to be longer.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["Preemption", "PreemptionConfig"]

_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")


@dataclass(frozen=True, kw_only=True)
class PreemptionConfig:
    # Each one asks for a stop at the next boundary; SIGINT too: Ctrl-C stops the job cleanly, checkpointed.
    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")
    grace_s: float = 60.0  # for the preemption checkpoint to commit
    on_grace_expiry: str = "exit"  # "exit": leave without it; "wait": keep waiting for the save

    def __post_init__(self) -> None:
        bad = [s for s in self.signals if s not in _SIGNALS]
        if bad:
            raise ValueError(f"preemption.signals: unknown signal {bad[0]!r} (one of {', '.join(_SIGNALS)})")
        if not self.grace_s > 0:
            raise ValueError(f"preemption.grace_s must be > 0, got {self.grace_s}")
        if self.on_grace_expiry not in ("exit", "wait"):
            raise ValueError(f"preemption.on_grace_expiry must be 'exit' or 'wait', got {self.on_grace_expiry!r}")


class Preemption:
    """This rank's stop flag: raised by a signal (or by :meth:`request`), read into the vote."""

    def __init__(self, config: PreemptionConfig) -> None:
        self.config = config
        self.signal: str | None = None  # the first one received
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
            self.signal = why

    def flag(self) -> float:
        """The stop slot of this rank's vote."""
        return 1.0 if self.signal is not None else 0.0

    def _on_signal(self, signum: int, frame: object) -> None:
        self.request(signal.Signals(signum).name)

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
