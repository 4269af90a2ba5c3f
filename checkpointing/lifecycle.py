"""Lifecycles of one save and of the manager, as explicit transition tables.

One save::

    STAGING -> WRITING -> COMMITTING -> COMMITTED
        \\          \\           \\-> FAILED
         \\-> FAILED  \\-> FAILED
    SKIPPED (a request dropped by the "skip" policy; terminal from the start)

The manager::

    OPEN -> CLOSING -> CLOSED
"""

from __future__ import annotations

import threading
from enum import Enum

from resilient_train.base.transitions import IllegalTransition

__all__ = ["ManagerState", "SavePhase", "SaveHandle"]


class SavePhase(str, Enum):
    STAGING = "staging"
    WRITING = "writing"
    COMMITTING = "committing"
    COMMITTED = "committed"
    FAILED = "failed"
    SKIPPED = "skipped"

    @property
    def terminal(self) -> bool:
        return self in (SavePhase.COMMITTED, SavePhase.FAILED, SavePhase.SKIPPED)


_SAVE_MOVES: dict[SavePhase, frozenset[SavePhase]] = {
    SavePhase.STAGING: frozenset({SavePhase.WRITING, SavePhase.FAILED}),
    SavePhase.WRITING: frozenset({SavePhase.COMMITTING, SavePhase.FAILED}),
    SavePhase.COMMITTING: frozenset({SavePhase.COMMITTED, SavePhase.FAILED}),
    SavePhase.COMMITTED: frozenset(),
    SavePhase.FAILED: frozenset(),
    SavePhase.SKIPPED: frozenset(),
}


class ManagerState(str, Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


MANAGER_MOVES: dict[ManagerState, frozenset[ManagerState]] = {
    ManagerState.OPEN: frozenset({ManagerState.CLOSING}),
    ManagerState.CLOSING: frozenset({ManagerState.CLOSED}),
    ManagerState.CLOSED: frozenset(),
}


def check_move(table: dict, current: Enum, new: Enum) -> None:
    if new not in table[current]:
        raise IllegalTransition(f"illegal transition {current.value} -> {new.value}")


class SaveHandle:
    """One save request: its phase, its error, and a way to wait for the end."""

    def __init__(self, step: int, phase: SavePhase = SavePhase.STAGING) -> None:
        self.step = step
        self._phase = phase
        self.error: str | None = None
        self.disk_full = False  # the save failed because the filesystem is full (checkpointing.errors)
        self._lock = threading.Lock()
        self._done = threading.Event()
        if phase.terminal:
            self._done.set()

    @property
    def phase(self) -> SavePhase:
        return self._phase

    def move(self, new: SavePhase, error: str | None = None) -> None:
        with self._lock:
            check_move(_SAVE_MOVES, self._phase, new)
            self._phase = new
            if error is not None:
                self.error = error
            if new.terminal:
                self._done.set()

    def wait(self, timeout: float) -> SavePhase:
        """Blocks until the save ends; raises ``TimeoutError`` after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint save of step {self.step} still {self._phase.value} after {timeout}s")
        return self._phase

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, phase={self._phase.value}, error={self.error!r})"
