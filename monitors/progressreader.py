"""A rank's progress slot read from another process (the node agent's monitors): never blocks, copes with a
missing or respawned slot. The slot's layout and its writer are :mod:`monitors.progress`.
"""

from __future__ import annotations

import mmap
import os
import struct

from monitors.progress import (
    _DONE_OFF, _ENTRY, _HEADER, _RING_OFF, _SEQ_OFF, _STATS, _STATS_OFF, DEVICE_PENDING, DEVICE_READY, DEVICE_SKIPPED,
    FLAG_CLOSED, FLAG_FIRST_STEP, MAGIC, NSECT, RING, SLOT_SIZE, VERSION, ProgressSnapshot, StepRecord, progress_path,
)
from monitors.sections import SECTIONS

__all__ = ["ProgressReader"]


class ProgressReader:
    """Reads one rank's slot from another process; never blocks, tolerates a missing file."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        self.rank = rank
        self.path = progress_path(run_dir, rank)
        self._mm: mmap.mmap | None = None
        self._ino = -1
        self._last: ProgressSnapshot | None = None  # the newest consistent read

    def _map(self) -> mmap.mmap | None:
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            self._unmap()
            return None
        if self._mm is not None and ino == self._ino:
            return self._mm
        self._unmap()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size < SLOT_SIZE:
                return None
            self._ino = os.fstat(fd).st_ino
            self._mm = mmap.mmap(fd, SLOT_SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return self._mm

    def _unmap(self) -> None:
        if self._mm is not None:
            self._mm.close()
        self._mm = None
        self._ino = -1

    def read(self) -> ProgressSnapshot | None:
        """A consistent snapshot, or ``None`` before the rank created its slot."""
        mm = self._map()
        if mm is None:
            return None
        for _ in range(200):
            before = struct.unpack_from("<Q", mm, _SEQ_OFF)[0]
            head = mm[:_RING_OFF]  # header and statistics: a few hundred bytes, copied in well under a microsecond
            if before % 2 == 0 and struct.unpack_from("<Q", mm, _SEQ_OFF)[0] == before:
                # No update began or ended while the copy was taken.
                self._last = _parse(self.rank, self._ino, head)
                return self._last
        # The writer is inside an update and not finishing it (descheduled, stopped, killed): what it
        # last published is what it did last.
        if self._last is not None and self._last.identity[0] == self._ino:
            return self._last
        return None

    def steps(self, snap: ProgressSnapshot, since: int) -> list[StepRecord]:
        """Completed steps of ``snap`` with ring index ``>= since``, read from the live slot.

        Completed entries do not change, except their device times, which are
        written before the state that marks them ready. An entry the writer may
        have reused since ``snap`` (it went on by a whole ring) is left out.
        """
        mm = self._map()
        if mm is None or self._ino != snap.identity[0]:
            return []  # the rank was respawned since ``snap``
        ring = mm[_RING_OFF:]
        now_done = struct.unpack_from("<Q", mm, _DONE_OFF)[0]  # read after the copy
        first = max(since, snap.steps_done - RING, now_done - RING + 1, 0)
        out = []
        for i in range(first, snap.steps_done):
            step, end, dur, device, *secs = _ENTRY.unpack_from(ring, (i % RING) * _ENTRY.size)
            out.append(StepRecord(
                step=step, end_s=end / 1e9, step_s=dur / 1e9,
                sections_s={name: ns / 1e9 for name, ns in zip(SECTIONS, secs[:NSECT])},
                device_sections_s=(
                    {name: ns / 1e9 for name, ns in zip(SECTIONS, secs[NSECT:])} if device == DEVICE_READY else None
                ),
                device_pending=device == DEVICE_PENDING,
                device_skipped=device == DEVICE_SKIPPED,
            ))
        return out

    def close(self) -> None:
        self._unmap()


def _parse(rank: int, ino: int, raw: bytes) -> ProgressSnapshot | None:
    magic, version, pid, flags, _seq, counter, step, code, generation, t, start, done = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION:
        return None
    stats = _STATS.unpack_from(raw, _STATS_OFF)
    return ProgressSnapshot(
        rank=rank, pid=pid, identity=(ino, pid, start), closed=bool(flags & FLAG_CLOSED),
        counter=counter, step=step, section=SECTIONS[code] if 0 <= code < NSECT else "startup",
        generation=generation, first_step=bool(flags & FLAG_FIRST_STEP),
        last_progress_s=t / 1e9, started_s=start / 1e9, steps_done=done,
        section_count={s: stats[3 * i] for i, s in enumerate(SECTIONS)},
        section_total_s={s: stats[3 * i + 1] / 1e9 for i, s in enumerate(SECTIONS)},
        section_max_s={s: stats[3 * i + 2] / 1e9 for i, s in enumerate(SECTIONS)},
    )
