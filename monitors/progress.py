"""Per-rank progress slots: what a rank's main thread is doing, readable by its node agent.

Each rank owns ``RUN_DIR/.monitors/rank{r}.progress``, a small memory-mapped file
that only the rank's **main thread** writes, at every section change. A thread
that keeps running while the main thread is stopped (SIGSTOP), spinning in C
code with the GIL held, blocked in a collective or in data loading, writes
nothing here, so a stuck rank shows no progress however healthy its other
threads are.

Layout (little endian; timestamps are ``CLOCK_MONOTONIC`` nanoseconds, which all
processes of one host share):

- header at 0: magic, version, pid, flags, seqlock, progress counter, step,
  section code, generation, time of the last ``enter``, time the reporter
  started, number of completed steps written to the ring;
- section statistics at 128: per section, count, total and largest duration;
- ring at 512: the last ``RING`` completed steps, each with its step number,
  end time, duration, per-section wall-clock durations and, on a GPU rank,
  per-section device durations (see ``monitors.device_timing``) with their
  state: none, pending (events not completed yet) or ready.

The writer brackets every update with an odd/even sequence number (a seqlock)
and readers retry until they copy a consistent image. A new reporter creates
its file under a temporary name and renames it, so a reader never sees a half
initialised slot and a respawned rank always gets a fresh file (a new inode).
The file's blocks are written before it is mapped: on a full filesystem the
reporter fails to start (``OSError``) instead of its rank dying of SIGBUS at
its first write to a page the filesystem cannot back.

This module is the slot's layout and its writer (:class:`ProgressReporter`, in the
rank); its reader (in the node agent) is :mod:`monitors.progressreader`.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from resilient_train.base.safefiles import create_exclusive
from monitors.sections import SECTIONS, Section, section_code

if TYPE_CHECKING:
    from monitors.device_timing import CudaSectionClock

__all__ = [
    "ProgressReporter",
    "ProgressSnapshot",
    "StepRecord",
    "progress_path",
]

MAGIC = b"RTP1"
VERSION = 3  # 3: the generation and the first-step flag
NSECT = len(SECTIONS)
RING = 256
FLAG_CLOSED = 1
FLAG_FIRST_STEP = 2  # the rank is in its first step of the current generation (see ProgressReporter)

_HEADER = struct.Struct("<4sIiIQQqiiqqQ")  # 72 bytes; the int after the section code is the generation
_SEQ_OFF = 16
_U64 = struct.Struct("<Q")
_DONE_OFF = 64  # the header's count of completed steps
_STATS_OFF = 128
_STATS = struct.Struct("<" + "QQQ" * NSECT)
_RING_OFF = 512
_ENTRY = struct.Struct("<qqqq" + "q" * NSECT + "q" * NSECT)  # step, end, duration, device state, wall, device
_STATE_OFF = 24  # the device-timing state within an entry
_DEVICE_OFF = 32 + 8 * NSECT  # the device durations within an entry
_DEVICE = struct.Struct("<" + "q" * NSECT)
# A GPU rank's step is "skipped" when the clock did not time it (see CudaSectionClock's min_gap_s).
DEVICE_NONE, DEVICE_PENDING, DEVICE_READY, DEVICE_SKIPPED = 0, 1, 2, 3
_DEVICE_STATES = {"none": DEVICE_NONE, "pending": DEVICE_PENDING, "skipped": DEVICE_SKIPPED}
SLOT_SIZE = _RING_OFF + RING * _ENTRY.size
_NO_DEVICE = (0,) * NSECT
_RECOVERY = section_code(Section.RECOVERY)
# Sections outside any step's work: a step that had only these is no first step done in its generation.
_NOT_WORK = frozenset(section_code(s) for s in (Section.STARTUP, Section.RECOVERY, Section.LOAD))


def progress_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / ".monitors" / f"rank{rank}.progress"


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One completed step as the rank timed it (seconds)."""

    step: int
    end_s: float
    step_s: float
    sections_s: dict[str, float]  # wall clock
    device_sections_s: dict[str, float] | None = None  # CUDA events, on a GPU rank once they completed
    device_pending: bool = False  # a GPU rank's step whose events had not completed when read
    device_skipped: bool = False  # a GPU rank's step that was not timed on the device (sampling)

    @property
    def timed_sections_s(self) -> dict[str, float]:
        """The best timing there is: the device's when the rank measured it, else the wall clock's."""
        return self.device_sections_s if self.device_sections_s is not None else self.sections_s


@dataclass(frozen=True, kw_only=True)
class ProgressSnapshot:
    """A consistent copy of one rank's slot."""

    rank: int
    pid: int
    identity: tuple[int, int, int]  # (inode, pid, start_ns): changes when the rank is respawned
    closed: bool
    counter: int
    step: int
    section: str
    generation: int  # what the writer said with ``enter`` (0 if it never said)
    first_step: bool  # in its first step of that generation
    last_progress_s: float  # monotonic seconds of the last ``enter``
    started_s: float
    steps_done: int
    section_count: dict[str, int]
    section_max_s: dict[str, float]
    section_total_s: dict[str, float]


class ProgressReporter:
    """Written by a rank's main thread; ``enter`` costs about a microsecond.

    ``enter(section, step)`` marks that the main thread now does ``section`` of
    ``step``. Time spent in the previous section is charged to it; when ``step``
    grows, the previous step is recorded in the ring. A step number that goes
    down (a rollback) drops the partial step. A section cut short by a fault
    (the next section is "recovery") is not an observation of its duration:
    a rank waiting on a hung peer would otherwise teach the hang detector that
    the all-reduce may take as long as the hang did.

    ``enter(..., generation=g)`` says which generation the rank is in (or,
    recovering, heading to). From a change of generation until the rank
    completes a step of work in it, the slot says "first step" (a
    replacement's first step runs on cold caches, and a survivor's waits in
    its collectives for peers still healing). Its sections are observations
    like any other: a timeout learned from a long step is only longer, and
    the hang detector judges a slow step by what the rank does, not by a
    timeout alone (monitors.hang).

    With ``cuda_device``, a timed step's every ``enter`` also records a CUDA
    event, and its entry gets per-section device times once its events
    complete. Steps shorter than ``cuda_min_gap_s`` are sampled by step
    number (one in 2, 4, ... so that timed steps are about that far apart),
    to bound the cost; the others' entries say "skipped".
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], rank: int, *, cuda_device: Any = None, cuda_min_gap_s: float = 0.05
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self._clock: CudaSectionClock | None = None
        if cuda_device is not None:
            from monitors import device_timing  # imports torch: GPU ranks only

            self._clock = device_timing.CudaSectionClock(cuda_device, NSECT, min_gap_s=cuda_min_gap_s)
        self.rank = rank
        self.path = progress_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = time.monotonic_ns()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = create_exclusive(tmp)  # never an existing file (or a link placed at the name)
        try:
            # Every block written now, not a sparse file: a page first touched through the map on a full
            # filesystem would be a SIGBUS, here an OSError (ENOSPC) the rank can report.
            _write_zeros(fd, SLOT_SIZE)
            self._mm = mmap.mmap(fd, SLOT_SIZE)
        except OSError:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        self._pid = os.getpid()
        self._start = now
        self._counter = 0
        self._step = -1
        self._code = section_code(Section.STARTUP)
        self._t = now
        self._step_t = now
        self._steps_done = 0
        self._flags = 0
        self._generation = 0
        self._seq = 0
        self._acc = [0] * NSECT
        self._stats = [0] * (3 * NSECT)
        self._write_header()
        os.replace(tmp, self.path)

    def _write_header(self) -> None:
        _store(self._mm, 0, _HEADER, MAGIC, VERSION, self._pid, self._flags, self._seq, self._counter,
               self._step, self._code, self._generation, self._t, self._start, self._steps_done)

    def _begin(self) -> None:
        """Opens an update: an odd sequence number tells readers to retry."""
        self._seq += 1
        _store(self._mm, _SEQ_OFF, _U64, self._seq)

    def _publish(self) -> None:
        """Closes an update: the even sequence number is stored alone, after every other byte."""
        self._seq += 1
        _store(self._mm, _SEQ_OFF, _U64, self._seq)

    def enter(self, section: str | Section, step: int, *, generation: int | None = None) -> None:
        now = time.monotonic_ns()
        code = section_code(section)
        prev = self._code
        boundary = step != self._step
        completed = boundary and step > self._step >= 0
        # CUDA calls first, outside the update: if one raises, the slot stays consistent.
        clock = self._clock
        device, ready = DEVICE_NONE, ()
        if clock is not None:
            if boundary:
                device = _DEVICE_STATES[clock.boundary(code, now, self._steps_done if completed else None, step)]
                ready = clock.ready() if clock.pending else ()
            elif code != prev:  # re-entering the section it is in adds no boundary
                clock.section(code)
        dt = now - self._t
        self._acc[prev] += dt
        st = self._stats
        if code != _RECOVERY:
            st[3 * prev] += 1
            st[3 * prev + 1] += dt
            if dt > st[3 * prev + 2]:
                st[3 * prev + 2] = dt
        mm = self._mm
        self._begin()
        if boundary:
            if completed:
                _store(mm, _entry_offset(self._steps_done), _ENTRY, self._step, now, now - self._step_t, device,
                       *self._acc, *_NO_DEVICE)
                self._steps_done += 1
                if prev not in _NOT_WORK:
                    self._flags &= ~FLAG_FIRST_STEP
            self._acc = [0] * NSECT
            self._step_t = now
            self._step = step
            if clock is not None:
                self._write_device_times(ready, clock.take_dropped())
        if generation is not None and generation != self._generation:
            self._generation = generation
            self._flags |= FLAG_FIRST_STEP
        self._code = code
        self._t = now
        self._counter += 1
        _store(mm, _STATS_OFF, _STATS, *st)
        self._write_header()
        self._publish()

    def _write_device_times(self, ready: Iterable[tuple[int, list[float]]], dropped: Iterable[int]) -> None:
        # Inside an update. Entries already overwritten in the ring are skipped.
        oldest = self._steps_done - RING
        for index in dropped:
            if index >= oldest:
                _store(self._mm, _entry_offset(index) + _STATE_OFF, _U64, DEVICE_SKIPPED)
        for index, seconds in ready:
            if index >= oldest:
                off = _entry_offset(index)
                _store(self._mm, off + _DEVICE_OFF, _DEVICE, *(round(x * 1e9) for x in seconds))
                _store(self._mm, off + _STATE_OFF, _U64, DEVICE_READY)  # after the times it vouches for

    def close(self) -> None:
        """Marks the slot closed (the rank finished): hang detection ignores it from now on."""
        if self._mm.closed:
            return
        ready = self._clock.ready() if self._clock is not None and self._clock.pending else ()
        self._begin()
        if self._clock is not None:
            self._write_device_times(ready, self._clock.take_dropped())
        self._flags |= FLAG_CLOSED
        self._write_header()
        self._publish()
        self._mm.close()

    def __enter__(self) -> "ProgressReporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _store(mm: mmap.mmap, offset: int, fmt: struct.Struct, *values: Any) -> None:
    """Writes ``values`` packed with ``fmt`` at ``offset`` with one copy of the final bytes.

    Not ``fmt.pack_into``: it clears the whole field to zero before writing
    each value, so a reader could see a zero sequence number (which reads as
    "no update in progress") or a zero timestamp (which reads as "no progress
    since the slot was created"). That is how a healthy GPU rank was once
    killed as idle for 11 s.
    """
    mm[offset:offset + fmt.size] = fmt.pack(*values)


def _write_zeros(fd: int, size: int) -> None:
    zeros = bytes(size)
    done = 0
    while done < size:
        done += os.write(fd, zeros[done:])


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _entry_offset(index: int) -> int:
    return _RING_OFF + (index % RING) * _ENTRY.size
