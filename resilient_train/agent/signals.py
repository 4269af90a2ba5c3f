"""The signals the agent forwards (``--signals-to-handle``): caught, and reported as one event each.

The handler only records the signal (and quiets Ctrl-C's tracebacks, which
reached the ranks too); the loop's next look turns it into a
:class:`~resilient_train.agent.events.Signalled` event, whose decision is the
shutdown (resilient_train.agent.ending) or, for a spare node that took no
node, leaving at once.
"""

from __future__ import annotations

import signal
from typing import Any

from resilient_train.agent.events import Signalled
from resilient_train.agent.workerio import Console

__all__ = ["SignalTrap"]


class SignalTrap:
    def __init__(self, names: tuple[str, ...], console: Console) -> None:
        self._names, self._console = names, console
        self._pending: int | None = None
        self._reported = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        def handler(signum: int, frame: object) -> None:
            self._pending = signum
            if signum == signal.SIGINT:
                self._console.interrupt()  # Ctrl-C reached the ranks too: no traceback per rank

        for name in self._names:
            signum = getattr(signal, name)
            try:
                self._previous[signum] = signal.signal(signum, handler)
            except ValueError:  # not the main thread (an agent run inside a test's thread)
                break

    @property
    def pending(self) -> int | None:
        return self._pending

    def poll(self) -> list[Signalled]:
        """The first signal received, once (a second one changes nothing: the shutdown has begun)."""
        if self._pending is None or self._reported:
            return []
        self._reported = True
        return [Signalled(signum=self._pending)]

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
