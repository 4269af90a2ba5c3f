"""A hang as the detector reports it (the rank, where it was, the evidence, how long) and which hung ranks to kill.

The detector (:mod:`monitors.hang`) finds them; the node agent kills the ranks :func:`ranks_to_kill` names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable

__all__ = ["Evidence", "Hang", "ranks_to_kill"]


class Evidence(str, Enum):
    """Why a rank past its timeout is taken for hung (see the module's doc)."""

    STOPPED = "stopped"  # its process is stopped (SIGSTOP, a debugger)
    IDLE = "idle"  # its processes used no CPU
    BUSY = "busy"  # it computed, and made no progress
    WAITING = "waiting"  # in a collective, with no local peer to blame
    TIMEOUT = "timeout"  # a fixed timeout (``timeouts_s``), start-up, or a section outside steps


@dataclass(frozen=True, kw_only=True)
class Hang:
    """A rank past its timeout. ``waiting_on`` lists local ranks outside a collective
    while this one waits in one: those are the likely culprits, and killing them
    first unblocks this rank. ``for_s`` is how long the evidence held (stopped
    for, idle for, or without progress), compared with ``timeout_s``."""

    rank: int
    pid: int | None  # None before the rank created its slot
    section: str
    step: int
    since_progress_s: float
    timeout_s: float
    evidence: str = Evidence.TIMEOUT.value
    for_s: float = 0.0
    waiting_on: tuple[int, ...] = ()

    @property
    def stopped(self) -> bool:
        """The process is stopped (SIGSTOP): it is hung whatever it waits for."""
        return self.evidence == Evidence.STOPPED.value

    @property
    def blocked_by_peer(self) -> bool:
        return bool(self.waiting_on)

    def describe(self) -> str:
        """Why, in words (the agent's kill line)."""
        where = f"in {self.section}" + (f" at step {self.step}" if self.step >= 0 else "")
        what = {
            Evidence.STOPPED.value: "stopped (SIGSTOP or a debugger) for",
            Evidence.IDLE.value: "no progress and no CPU used for",
            Evidence.BUSY.value: "computing with no progress for",
            Evidence.WAITING.value: "waiting on other nodes with no progress for",
        }.get(self.evidence, "no progress for")
        return f"hung {where}: {what} {self.for_s:.1f} s (timeout {self.timeout_s:.1f} s)"


def ranks_to_kill(hangs: list[Hang], collective_sections: Iterable[str]) -> list[int]:
    """The hung ranks to kill: never one merely waiting on a local peer, and,
    when every hung rank waits in a collective, only the stopped ones, else
    only the ones behind.

    A rank that stopped just after an all-reduce still shows that all-reduce,
    one step behind its peers waiting in the next one. Killing them all would
    leave no rank holding a snapshot to resume from. A rank stopped inside
    the collective shows the same section and step as the peers it blocks.
    """
    kill = [h for h in hangs if not h.blocked_by_peer]
    collective = set(collective_sections)
    if len(kill) > 1 and all(h.section in collective for h in kill):
        stopped = [h for h in kill if h.stopped]
        if stopped:
            kill = stopped
        else:
            lowest = min(h.step for h in kill)
            kill = [h for h in kill if h.step == lowest]
    return sorted(h.rank for h in kill)
