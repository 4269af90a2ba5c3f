"""What a rank's processes are doing, read from ``/proc``: stopped or not, and the CPU time they used.

The hang detector asks this only of a rank that has made no progress for a
while, to tell a slow step from a hang: a rank whose processes use CPU is
working (an evaluation, a long step); one that is stopped (SIGSTOP, a
debugger) cannot be; one whose processes use no CPU at all is blocked (a
deadlock, an I/O that never returns). The CPU time counted is the rank's
process (every thread) and its live children (DataLoader workers, the
checkpoint writer), so a main thread waiting on its workers is not idle
while they work.

The state letter is the main thread's (``/proc/PID/stat`` of a thread group
leader): ``T`` (stopped) and ``t`` (stopped by a tracer) mean it cannot run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ProcSample", "STOPPED_STATES", "sample_process"]

STOPPED_STATES = frozenset({"T", "t"})
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_MAX_CHILDREN = 256  # a rank's DataLoader workers and its writer; a fork bomb is not read in full


@dataclass(frozen=True)
class ProcSample:
    state: str  # the main thread's state letter: R, S, D, T, t, Z, ...
    cpu_s: float  # user + system CPU seconds of the process (all threads) and of its live children

    @property
    def stopped(self) -> bool:
        return self.state in STOPPED_STATES


def _stat(pid: int) -> tuple[str, float] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields are counted after its last ')'.
    fields = raw.rsplit(b")", 1)[-1].split()
    try:
        state = fields[0].decode()
        utime, stime = int(fields[11]), int(fields[12])
    except (IndexError, ValueError):
        return None
    return state, (utime + stime) * _TICK_S


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
        if len(out) >= _MAX_CHILDREN:
            break
    return out[:_MAX_CHILDREN]


def sample_process(pid: int) -> ProcSample | None:
    """``pid``'s state and the CPU seconds of it and its live children; None when it is gone."""
    own = _stat(pid)
    if own is None:
        return None
    state, cpu = own
    for child in _children(pid):
        got = _stat(child)
        if got is not None:
            cpu += got[1]
    return ProcSample(state=state, cpu_s=cpu)
