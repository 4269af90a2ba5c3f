"""Per rank, the evidence of what it does while it makes no progress: stopped, computing, or blocked.

The hang detector tracks a rank here once it has gone :data:`PROBE_AFTER_S`
without progress, and forgets it as soon as it makes progress again. Each look
(at most every :data:`PROBE_EVERY_S`) reads the rank's processes
(:mod:`monitors.procstat`):

* **stopped**: since when the rank's main thread has been seen stopped
  (SIGSTOP, a debugger), without a break;
* **busy**: the last time its processes used CPU at a rate above
  :data:`BUSY_CPU_FRACTION` of one core over the last :data:`WINDOW_S`
  (an evaluation, a long step, DataLoader workers at work). The runtime's
  own threads in a blocked rank (the generation watcher's store polls) use
  well under 1% of a core. A rank is taken as busy from the first look that
  finds its process, so it is idle only once a whole window showed it idle;
  a process that is gone (its exit not reaped yet) is idle.

Times are the agent's monotonic seconds. :meth:`Activity.clear` drops
everything (the agent's clock jumped: its own pause is no evidence about the
ranks).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from monitors.procstat import sample_process

__all__ = ["Activity", "BUSY_CPU_FRACTION", "PROBE_AFTER_S", "PROBE_EVERY_S", "RankActivity", "WINDOW_S", "idle_for"]

PROBE_AFTER_S = 0.5  # a rank is watched this closely only after this long without progress
PROBE_EVERY_S = 0.25
WINDOW_S = 1.0
BUSY_CPU_FRACTION = 0.05


@dataclass
class RankActivity:
    pid: int
    busy_at: float | None = None  # the last look that showed it working (the first look that found it counts)
    first_at: float | None = None  # the first look that found its process
    stopped_since: float | None = None  # seen stopped at every look since then
    looked_at: float = 0.0
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, cpu seconds)


def idle_for(act: RankActivity, since: float, now: float) -> float:
    """How long ``act``'s rank has shown no work (at most ``since``, its time without progress); 0 until a
    whole window of looks could have shown work. A process that was gone at every look is idle since."""
    if act.first_at is None:
        return since if act.looked_at else 0.0
    if now - act.first_at < WINDOW_S:
        return 0.0
    assert act.busy_at is not None
    return min(since, now - act.busy_at)


class Activity:
    """What the detector knows of the ranks that stopped making progress."""

    def __init__(self) -> None:
        self._ranks: dict[int, RankActivity] = {}

    def forget(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def clear(self) -> None:
        self._ranks.clear()

    def look(self, rank: int, pid: int, now: float) -> RankActivity:
        """The rank's activity, with a fresh look at its processes when the last one is old enough."""
        act = self._ranks.get(rank)
        if act is None or act.pid != pid:
            act = self._ranks[rank] = RankActivity(pid=pid)
        if now - act.looked_at < PROBE_EVERY_S:
            return act
        act.looked_at = now
        got = sample_process(pid)
        if got is None:  # gone: its exit is the workers' poller's to report
            return act
        if act.busy_at is None:
            act.busy_at = act.first_at = now
        if got.stopped:
            if act.stopped_since is None:
                act.stopped_since = now
        else:
            act.stopped_since = None
        act.samples.append((now, got.cpu_s))
        while len(act.samples) > 2 and act.samples[1][0] <= now - WINDOW_S:
            act.samples.popleft()
        t0, cpu0 = act.samples[0]
        if now - t0 >= WINDOW_S and (got.cpu_s - cpu0) / (now - t0) > BUSY_CPU_FRACTION:
            act.busy_at = now
        return act
