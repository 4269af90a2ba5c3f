"""Hang detection from progress slots and evidence: a slow step is not a hang.

The node agent calls ``HangDetector.poll(now)`` from its monitor loop. A rank
that has made no progress (its main thread entered no section) for a while is
looked at more closely (:mod:`monitors.activity`: its process state and the
CPU its processes use), and judged by what it does:

* **stopped** (SIGSTOP, a debugger) while the agent itself runs: hung after
  ``stopped_timeout_s`` (3 s). A stopped process cannot be working.
* **idle**: outside a collective, its processes (every thread, and its
  children such as DataLoader workers) used no CPU: hung after
  ``idle_timeout_s`` (60 s) or the section's computed timeout, whichever is
  longer (a deadlock, an I/O that never returns);
* **busy**: it computes (an evaluation inside the step, a long first step,
  logging): hung only after ``busy_timeout_s`` (30 min) or the computed
  timeout, whichever is longer (a livelock);
* **waiting** in a collective: it waits on peers. On a local peer outside
  the collective: never blamed (the peer is judged). On none here (the
  culprit is on another node, whose agent judges it, or the group broke, which
  the group's own timeout ends): hung only after the busy limit. A rank that
  shows a collective while a local peer of its generation is at a later step
  is not in it any more (its collective completed for that peer): it is
  judged by its own evidence; so is one in a collective of an earlier
  generation than a local peer's (its peers left that generation).

Timeouts of the sections outside steps: ``startup_timeout_s`` before a rank's
first progress and in "startup"; ``long_section_timeout_s`` in "load",
"checkpoint" and "recovery". ``timeouts_s`` fixes a section's timeout (any
evidence but "stopped"). The computed timeout of a section is the largest
duration any rank has shown for it, times ``safety_factor``, once the section
has been seen ``min_observations`` times across ranks (at most the longest
timeout the configuration grants, ``HangConfig.longest_timeout_s``). Every
completed section counts, long ones and first steps of a generation included;
a section cut short by a fault does not (monitors.progress).

A pause of the agent itself (its clock jumped between two looks: the whole job
was stopped and continued, a suspended Slurm job, a frozen VM) is never charged
to the ranks: :meth:`HangDetector.paused` starts every clock again.

The old names (``min_timeout_s``, ``default_timeout_s``, and the ones without
``_s``) still work for one release, with a ``DeprecationWarning``: both are now
``idle_timeout_s``, the floor of a computed timeout.

A rank in a collective is timed from the moment the last of its local peers in
that generation entered one, not from its own entry.

Only ranks that report progress are watched: a rank with no slot (a plain
torchrun script that neither uses the Supervisor nor calls
``resilient_train.rank.heartbeat``) is never taken for hung, however long it runs.
A respawned rank whose predecessor reported (``reset(..., expect_progress=True)``)
is watched from its spawn, so a replacement stuck in start-up is caught.

The observed maxima are merged across ranks and across respawns, and export to
plain JSON data (``state_dict``) so a checkpoint can carry them. Loading such
data back (``load_state_dict``) checks every number first: a forged checkpoint
saying every section once took 1e308 s would otherwise switch hang detection
off (docs/security.md). Merging keeps the larger maximum: a timeout learned
from a checkpoint never shrinks below what this job has seen.

Its configuration is :mod:`monitors.hangconfig`; what it reports, and which
hung ranks to kill, :mod:`monitors.hangverdict`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable

from monitors.activity import PROBE_AFTER_S, Activity, RankActivity, idle_for
from resilient_train.base.configfile import (
    MAX_COUNT, MAX_SECONDS, kind, require_int, require_number,
)
from monitors.progress import ProgressSnapshot
from monitors.progressreader import ProgressReader
from monitors.hangconfig import HangConfig
from monitors.hangverdict import Evidence, Hang
from monitors.sections import LONG_SECTIONS, SECTIONS, Section

RECOVERY = Section.RECOVERY.value
STARTUP = Section.STARTUP.value
LOAD = Section.LOAD.value

__all__ = ["HangDetector"]

IMPOSSIBLE_READS_BEFORE_JUDGING = 20  # about a second of the agent's polls
# A section a rank finished was shorter than the timeout applied to it (else the rank was killed), give or
# take the agent's poll: a saved maximum above twice the longest timeout was not observed, it was written.
OBSERVED_SLACK = 2.0


class HangDetector:
    """Polled by the node agent; ``poll`` reads memory-mapped files and ``/proc``, and never blocks."""

    def __init__(self, config: HangConfig, run_dir: str | os.PathLike[str], ranks: Iterable[int]) -> None:
        self.config = config
        self.run_dir = run_dir
        self._readers = {r: ProgressReader(run_dir, r) for r in ranks}
        now = time.monotonic()
        self._since = {r: now for r in self._readers}  # start of the startup window
        self._expected: set[int] = set()  # ranks watched before they write a slot (see reset)
        self._stale: dict[int, tuple[int, int, int] | None] = {r: None for r in self._readers}
        self._max: dict[str, float] = {}
        self._count: dict[str, int] = {}
        # Per rank, the last stats folded into _count (counts are cumulative per incarnation).
        self._seen: dict[tuple[int, tuple[int, int, int]], dict[str, int]] = {}
        self.last: dict[int, ProgressSnapshot | None] = {r: None for r in self._readers}
        self.inconsistent_reads = 0  # slot reads whose progress time was impossible
        self._impossible: dict[int, int] = {}  # consecutive such reads per rank
        self._activity = Activity()
        self._resumed_at = float("-inf")  # the agent's clock jumped (its own pause): nothing before counts

    @property
    def ranks(self) -> list[int]:
        return sorted(self._readers)

    def reset(self, rank: int, now: float | None = None, *, expect_progress: bool = False) -> None:
        """``rank`` was (re)spawned: ignore its old slot and give it a start-up window.

        With ``expect_progress`` (its predecessor reported progress), the window is
        watched before the new process writes a slot; otherwise only once it does.
        """
        if expect_progress:
            self._expected.add(rank)
        else:
            self._expected.discard(rank)
        if rank not in self._readers:
            self._readers[rank] = ProgressReader(self.run_dir, rank)
        snap = self._readers[rank].read()
        self._stale[rank] = snap.identity if snap is not None else None
        self._since[rank] = time.monotonic() if now is None else now
        self.last[rank] = None
        self._activity.forget(rank)

    def remove(self, rank: int) -> None:
        reader = self._readers.pop(rank, None)
        if reader is not None:
            reader.close()
        for d in (self._since, self._stale, self.last):
            d.pop(rank, None)
        self._expected.discard(rank)
        self._activity.forget(rank)

    def read(self, rank: int) -> ProgressSnapshot | None:
        """``rank``'s slot now (None: none, or only its predecessor's)."""
        reader = self._readers.get(rank)
        snap = reader.read() if reader is not None else None
        return None if snap is None or snap.identity == self._stale.get(rank) else snap

    def paused(self, resumed_at: float) -> None:
        """The agent did not run until ``resumed_at`` (its clock jumped): every clock starts again there."""
        self._resumed_at = max(self._resumed_at, resumed_at)
        self._activity.clear()

    def computed(self, section: str) -> float | None:
        """The section's computed timeout, once it has been observed often enough (None before, or off)."""
        c = self.config
        if c.computed and self._count.get(section, 0) >= c.min_observations:
            return min(c.safety_factor * self._max[section], c.longest_timeout_s)
        return None

    def timeout(self, section: str) -> float:
        """The timeout applied now to an idle rank in ``section`` (the shortest but a stopped rank's)."""
        c = self.config
        if section in c.timeouts_s:
            return c.timeouts_s[section]
        if section == STARTUP:
            return c.startup_timeout_s
        if section in LONG_SECTIONS:
            return c.long_section_timeout_s
        return max(c.idle_timeout_s, self.computed(section) or 0.0)

    def poll(self, now: float | None = None) -> list[Hang]:
        """Hung ranks, oldest progress first. ``now`` is ``time.monotonic()`` seconds."""
        now = time.monotonic() if now is None else now
        live: dict[int, ProgressSnapshot | None] = {}
        for rank, reader in self._readers.items():
            snap = reader.read()
            if snap is not None and snap.identity == self._stale[rank]:
                snap = None
            self.last[rank] = snap
            if snap is not None:
                self._observe(rank, snap)
                if snap.closed:
                    self._activity.forget(rank)
                    continue
            live[rank] = snap
        if not self.config.enabled:
            return []
        collective = self.config.collective_sections
        arrived: dict[int, float] = {}  # per generation, when the last local rank entered a collective
        ahead: tuple[int, int] = (-1, -1)  # the latest (generation, step) a local rank is at
        for snap in live.values():
            if snap is not None and snap.counter:
                ahead = max(ahead, (snap.generation, snap.step))
                if snap.section in collective and snap.started_s <= snap.last_progress_s <= now + 1.0:
                    arrived[snap.generation] = max(arrived.get(snap.generation, 0.0), snap.last_progress_s)
        hangs = []
        for rank, snap in live.items():
            if snap is None and rank not in self._expected:
                continue  # never reported progress: not watched
            if snap is None or snap.counter == 0:
                section, step, pid = STARTUP, -1, (snap.pid if snap else None)
                start = self._since[rank] if snap is None else max(self._since[rank], snap.started_s)
            else:
                section, step, pid = snap.section, snap.step, snap.pid
                if snap.started_s <= snap.last_progress_s <= now + 1.0:
                    self._impossible[rank] = 0
                    # Never more idle time than since this process was first watched (reset at its spawn).
                    start = max(snap.last_progress_s, self._since[rank])
                    if section in collective:  # its collective could not end before its last local peer came
                        start = max(start, arrived.get(snap.generation, start))
                else:
                    # A time its writer never wrote: a damaged slot. Judged once it has stayed so
                    # for a while, by the time since the rank was first watched.
                    self.inconsistent_reads += 1
                    self._impossible[rank] = self._impossible.get(rank, 0) + 1
                    if self._impossible[rank] < IMPOSSIBLE_READS_BEFORE_JUDGING:
                        continue
                    start = self._since[rank]
            since = now - max(start, self._resumed_at)
            if pid is None or since < PROBE_AFTER_S:
                self._activity.forget(rank)
                act = None
            else:
                act = self._activity.look(rank, pid, now)
            # In a collective that a local peer has left (it is at a later step, or in a later generation), a
            # rank waits for nothing that will come: it is judged by its own evidence, as a culprit.
            behind = snap is not None and (snap.generation, snap.step) < ahead
            verdict = self._judge(section, since, now, act, waits=section in collective and not behind)
            if verdict is not None:
                evidence, for_s, limit = verdict
                waiting = () if behind else self._waiting_on(rank, section, live)
                hangs.append(Hang(rank=rank, pid=pid, section=section, step=step, since_progress_s=since,
                                  timeout_s=limit, evidence=evidence.value, for_s=for_s, waiting_on=waiting))
        hangs.sort(key=lambda h: -h.since_progress_s)
        return hangs

    def _judge(self, section: str, since: float, now: float, act: RankActivity | None, *,
               waits: bool) -> tuple[Evidence, float, float] | None:
        """(evidence, how long it held, the timeout it passed), or None: not hung."""
        c = self.config
        if act is not None and act.stopped_since is not None:
            stopped = now - max(act.stopped_since, self._resumed_at)
            if stopped > c.stopped_timeout_s:
                return Evidence.STOPPED, stopped, c.stopped_timeout_s
        if section in c.timeouts_s or section == STARTUP or section in LONG_SECTIONS:
            limit = self.timeout(section)
            return (Evidence.TIMEOUT, since, limit) if since > limit else None
        computed = self.computed(section) or 0.0
        busy_limit = max(c.busy_timeout_s, computed)
        if waits:
            return (Evidence.WAITING, since, busy_limit) if since > busy_limit else None
        idle_limit = max(c.idle_timeout_s, computed)
        idle = idle_for(act, since, now) if act is not None else 0.0
        if idle > idle_limit:
            return Evidence.IDLE, idle, idle_limit
        return (Evidence.BUSY, since, busy_limit) if since > busy_limit else None

    def _waiting_on(self, rank: int, section: str, live: dict[int, ProgressSnapshot | None]) -> tuple[int, ...]:
        """The peers a rank past its timeout waits for, if it waits at all.

        In a collective it waits for peers outside one, unless they went on to
        a later generation's recovery (then nothing will come: it is stuck); a
        peer still in recovery into this rank's own generation (healing,
        rebuilding its DDP) is one it waits for. In recovery it waits for
        every peer that has not joined it there and is not already training in
        its generation or a later one (a peer still stuck in an old
        collective, or a replacement starting up).
        """
        collective = self.config.collective_sections
        me = live[rank]
        gen = me.generation if me is not None else 0
        if section in collective:
            return tuple(sorted(r for r, s in live.items() if r != rank and (
                s is None or (s.section not in collective and (s.section != RECOVERY or s.generation <= gen)))))
        if section == RECOVERY:
            def ahead(s: ProgressSnapshot) -> bool:
                return s.generation >= gen and s.section not in (STARTUP, LOAD)

            return tuple(sorted(r for r, s in live.items() if r != rank and (
                s is None or (s.section != RECOVERY and not ahead(s)))))
        return ()

    def _observe(self, rank: int, snap: ProgressSnapshot) -> None:
        key = (rank, snap.identity)
        seen = self._seen.setdefault(key, {})
        for section in SECTIONS:
            n = snap.section_count[section]
            if n > seen.get(section, 0):
                self._count[section] = self._count.get(section, 0) + n - seen.get(section, 0)
                seen[section] = n
                self._max[section] = max(self._max.get(section, 0.0), snap.section_max_s[section])
        if len(self._seen) > 4 * len(self._readers) + 16:  # forget old incarnations
            current = {(r, s.identity) for r, s in self.last.items() if s is not None}
            self._seen = {k: v for k, v in self._seen.items() if k in current}

    def state_dict(self) -> dict[str, Any]:
        """The observed maxima and counts per section, as JSON-able data for a checkpoint."""
        return {
            "version": 1,
            "observed_max_s": dict(sorted(self._max.items())),
            "observations": dict(sorted(self._count.items())),
            "timeouts_s": {s: self.timeout(s) for s in SECTIONS},
        }

    def load_state_dict(self, state: Any) -> None:
        """Merges saved observations (largest maxima win, counts add up).

        Every value is checked before anything is merged: a maximum must be a finite number in
        [0, ``OBSERVED_SLACK`` x ``longest_timeout_s``], a count an integer in [0, ``MAX_COUNT``], a saved
        timeout a number in (0, ``MAX_SECONDS``] (then unused: timeouts are computed again here). A bad
        one raises ``ValueError`` (one line naming the field) and changes nothing. Sections this version
        does not know are ignored.
        """
        if not isinstance(state, dict):
            raise ValueError(f"the hang-detector state must be a mapping, got {kind(state)}")
        version = state.get("version")
        if isinstance(version, bool) or version != 1:
            raise ValueError(f"unsupported hang-detector state version {version!r}")
        high = OBSERVED_SLACK * self.config.longest_timeout_s
        maxima = {s: float(require_number(v, f"hang.observed_max_s.{s}", low=0, high=high))
                  for s, v in _known_sections(state, "observed_max_s").items()}
        counts = {s: require_int(n, f"hang.observations.{s}", low=0, high=MAX_COUNT)
                  for s, n in _known_sections(state, "observations").items()}
        for s, t in _known_sections(state, "timeouts_s").items():  # checked too, though computed again here
            require_number(t, f"hang.timeouts_s.{s}", above=0, high=MAX_SECONDS)
        for section, v in maxima.items():
            self._max[section] = max(self._max.get(section, 0.0), v)
        for section, n in counts.items():
            self._count[section] = min(MAX_COUNT, self._count.get(section, 0) + n)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


def _known_sections(state: dict[str, Any], name: str) -> dict[str, Any]:
    values = state.get(name, {})
    if not isinstance(values, dict):
        raise ValueError(f"hang.{name} must be a mapping of section to a number, got {kind(values)}")
    return {s: v for s, v in values.items() if s in SECTIONS}
