"""Hang detection from progress slots: which rank has made no progress for too long.

The node agent calls ``HangDetector.poll(now)`` from its monitor loop. A rank is
hung when the time since its main thread last entered a section exceeds that
section's timeout. Timeouts are, in order of precedence:

1. explicit, per section (``HangConfig.timeouts_s``);
2. ``startup_timeout_s`` before a rank's first progress and in "startup";
   ``long_section_timeout_s`` in "load", "checkpoint" and "recovery";
3. computed: the largest duration any rank has shown for the section, times
   ``safety_factor`` (at least ``min_timeout_s``, at most the longest timeout the
   configuration grants: ``HangConfig.longest_timeout_s``), once the section has
   been seen ``min_observations`` times across ranks; in a rank's first step of a
   generation (its slot says so), at least ``default_timeout_s``: a
   replacement's first step runs on cold caches and a survivor's first
   collective waits for peers still healing;
4. ``default_timeout_s`` otherwise.

The names without ``_s`` (``min_timeout``, ``timeouts``, ...) still work for one release, with a
``DeprecationWarning``.

A rank in a collective is timed from the moment the last of its local peers
in that generation entered one, not from its own entry: it cannot be blamed
for the time a slower peer took to arrive (the peer, outside the collective,
is the one timed meanwhile). When every hung rank waits in a collective, a
stopped process (SIGSTOP) among them is the culprit.

Only ranks that report progress are watched: a rank with no slot (a plain
torchrun script that neither uses the Supervisor nor calls
``resilient_train.heartbeat``) is never taken for hung, however long it runs.
A respawned rank whose predecessor reported (``reset(..., expect_progress=True)``)
is watched from its spawn, so a replacement stuck in start-up is caught.

The observed maxima are merged across ranks and across respawns, and export to
plain JSON data (``state_dict``) so a checkpoint can carry them. Loading such
data back (``load_state_dict``) checks every number first: a forged checkpoint
saying every section once took 1e308 s would otherwise switch hang detection
off (docs/security.md).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from monitors.configfile import MAX_COUNT, MAX_SECONDS, kind, require_bool, require_int, require_number, require_strs
from monitors.configtree import renamed
from monitors.progress import ProgressReader, ProgressSnapshot
from monitors.sections import COLLECTIVE_SECTIONS, LONG_SECTIONS, SECTIONS, Section
from monitors.stacks import is_stopped

RECOVERY = Section.RECOVERY.value
STARTUP = Section.STARTUP.value
LOAD = Section.LOAD.value

__all__ = ["Hang", "HangConfig", "HangDetector", "ranks_to_kill"]

IMPOSSIBLE_READS_BEFORE_JUDGING = 20  # about a second of the agent's polls
MAX_SAFETY_FACTOR = 100.0
# A section a rank finished was shorter than the timeout applied to it (else the rank was killed), give or
# take the agent's poll: a saved maximum above twice the longest timeout was not observed, it was written.
OBSERVED_SLACK = 2.0


@renamed(timeouts="timeouts_s", min_timeout="min_timeout_s", default_timeout="default_timeout_s",
         startup_timeout="startup_timeout_s", long_section_timeout="long_section_timeout_s",
         longest_timeout="longest_timeout_s")
@dataclass(kw_only=True)
class HangConfig:
    enabled: bool = True  # off: no rank is ever taken for hung
    timeouts_s: dict[str, float] = field(default_factory=dict)  # per section, seconds: fixed, never computed
    computed: bool = True  # timeouts computed from the durations observed (else the defaults below)
    safety_factor: float = 5.0  # a computed timeout: this times the longest duration seen for the section
    min_observations: int = 10  # times a section is seen, across ranks, before its timeout is computed
    min_timeout_s: float = 3.0  # a floor: a loaded host may deschedule a healthy rank for a while
    default_timeout_s: float = 60.0  # a section not yet computed, and every rank's first step of a generation
    startup_timeout_s: float = 300.0  # before a rank's first progress, and in "startup"
    long_section_timeout_s: float = 600.0  # in "load", "checkpoint" and "recovery"
    collective_sections: tuple[str, ...] = tuple(sorted(COLLECTIVE_SECTIONS))  # a rank in these waits on peers

    def __post_init__(self) -> None:
        require_bool(self.enabled, "hang.enabled")
        require_bool(self.computed, "hang.computed")
        if not isinstance(self.timeouts_s, dict):
            raise ValueError(f"hang.timeouts_s must be a mapping of section to seconds, got {kind(self.timeouts_s)}")
        unknown = sorted(str(s) for s in set(self.timeouts_s) - set(SECTIONS))
        if unknown:
            raise ValueError(f"hang.timeouts_s: unknown sections {unknown}; expected some of {list(SECTIONS)}")
        for section, t in self.timeouts_s.items():
            require_number(t, f"hang.timeouts_s.{section}", above=0, high=MAX_SECONDS)
        for name in ("min_timeout_s", "default_timeout_s", "startup_timeout_s", "long_section_timeout_s"):
            require_number(getattr(self, name), f"hang.{name}", above=0, high=MAX_SECONDS)
        require_number(self.safety_factor, "hang.safety_factor", above=0, high=MAX_SAFETY_FACTOR)
        require_int(self.min_observations, "hang.min_observations", low=1, high=MAX_COUNT)
        self.collective_sections = require_strs(self.collective_sections, "hang.collective_sections",
                                                choices=SECTIONS)

    @property
    def longest_timeout_s(self) -> float:
        """The longest timeout this configuration grants any section; a computed one never exceeds it."""
        return max(self.default_timeout_s, self.startup_timeout_s, self.long_section_timeout_s,
                   *self.timeouts_s.values())


@dataclass(frozen=True, kw_only=True)
class Hang:
    """A rank past its timeout. ``waiting_on`` lists local ranks outside a collective
    while this one waits in one: those are the likely culprits, and killing them
    first unblocks this rank."""

    rank: int
    pid: int | None  # None before the rank created its slot
    section: str
    step: int
    since_progress_s: float
    timeout_s: float
    waiting_on: tuple[int, ...] = ()
    stopped: bool = False  # the process is stopped (SIGSTOP): it is hung whatever it waits for

    @property
    def blocked_by_peer(self) -> bool:
        return bool(self.waiting_on)


class HangDetector:
    """Polled by the node agent; ``poll`` only reads memory-mapped files and never blocks."""

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

    def remove(self, rank: int) -> None:
        reader = self._readers.pop(rank, None)
        if reader is not None:
            reader.close()
        for d in (self._since, self._stale, self.last):
            d.pop(rank, None)
        self._expected.discard(rank)

    def timeout(self, section: str, *, first_step: bool = False) -> float:
        """The timeout applied now to a rank in ``section`` (of its first step in a generation)."""
        c = self.config
        if section in c.timeouts_s:
            return c.timeouts_s[section]
        if section == "startup":
            return c.startup_timeout_s
        if section in LONG_SECTIONS:
            return c.long_section_timeout_s
        if c.computed and self._count.get(section, 0) >= c.min_observations:
            computed = min(max(c.min_timeout_s, c.safety_factor * self._max[section]), c.longest_timeout_s)
            return max(computed, c.default_timeout_s) if first_step else computed
        return c.default_timeout_s

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
                    continue
            live[rank] = snap
        if not self.config.enabled:
            return []
        collective = self.config.collective_sections
        arrived: dict[int, float] = {}  # per generation, when the last local rank entered a collective
        for snap in live.values():
            if snap is not None and snap.counter and snap.section in collective and \
                    snap.started_s <= snap.last_progress_s <= now + 1.0:
                arrived[snap.generation] = max(arrived.get(snap.generation, 0.0), snap.last_progress_s)
        hangs = []
        for rank, snap in live.items():
            if snap is None and rank not in self._expected:
                continue  # never reported progress: not watched
            if snap is None or snap.counter == 0:
                section, step, pid = "startup", -1, (snap.pid if snap else None)
                since = now - (self._since[rank] if snap is None else max(self._since[rank], snap.started_s))
            else:
                section, step, pid = snap.section, snap.step, snap.pid
                if snap.started_s <= snap.last_progress_s <= now + 1.0:
                    self._impossible[rank] = 0
                    # Never more idle time than since this process was first watched (reset at its spawn).
                    start = max(snap.last_progress_s, self._since[rank])
                    if section in collective:  # its collective could not end before its last local peer came
                        start = max(start, arrived.get(snap.generation, start))
                    since = now - start
                else:
                    # A time its writer never wrote: a damaged slot. Judged once it has stayed so
                    # for a while, by the time since the rank was first watched.
                    self.inconsistent_reads += 1
                    self._impossible[rank] = self._impossible.get(rank, 0) + 1
                    if self._impossible[rank] < IMPOSSIBLE_READS_BEFORE_JUDGING:
                        continue
                    since = now - self._since[rank]
            limit = self.timeout(section, first_step=snap is not None and snap.first_step)
            if since > limit:
                waiting = self._waiting_on(rank, section, live)
                hangs.append(Hang(rank=rank, pid=pid, section=section, step=step,
                                  since_progress_s=since, timeout_s=limit, waiting_on=waiting,
                                  stopped=pid is not None and is_stopped(pid)))
        hangs.sort(key=lambda h: -h.since_progress_s)
        return hangs

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
