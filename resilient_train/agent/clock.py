"""The agent's own clock between two looks: a jump is the agent's pause, never the ranks' fault.

The agent looks at its ranks every ``monitor_interval_s`` (50 ms). When two
looks are :data:`PAUSE_S` or more apart, the agent did not run meanwhile: the
whole job was stopped and continued (Ctrl-Z then ``fg``, ``scontrol
suspend``/``resume``, SIGSTOP to the process group), or its host froze (a VM
migrated). The ranks were stopped with it, or ran unwatched; either way the
time is no evidence against them: the hang detector and the store host's
census of the agents' beats start their clocks again (monitors.hang
``HangDetector.paused``, resilient_train.protocol.succession.census ``Census.excuse``).
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["PAUSE_S", "PauseClock"]

PAUSE_S = 1.0  # twenty looks missed: the agent was not running


class PauseClock:
    def __init__(self, *, on_pause: Callable[[float], None], pause_s: float = PAUSE_S) -> None:
        """``on_pause(seconds)``: called by the look that found a pause, with its length."""
        self.pause_s = pause_s
        self._on_pause = on_pause
        self._last: float | None = None
        self.paused_s = 0.0  # in all, for the record
        self.paused_at: float | None = None  # when the last pause was found

    def paused_within(self, seconds: float) -> bool:
        """Whether a pause was found in the last ``seconds``."""
        return self.paused_at is not None and time.monotonic() - self.paused_at <= seconds

    def restart(self) -> None:
        """The agent was busy on purpose until now (a blocking step of its own): the next look starts afresh."""
        self._last = None

    def tick(self, now: float | None = None) -> float | None:
        """One look; the seconds since the previous one when they make a pause, else None."""
        now = time.monotonic() if now is None else now
        last, self._last = self._last, now
        if last is None or now - last < self.pause_s:
            return None
        self.paused_s += now - last
        self.paused_at = now
        self._on_pause(now - last)
        return now - last
