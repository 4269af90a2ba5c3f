"""Reading ``events.jsonl`` incrementally, as other processes append to it.

The dashboard re-reads the log every half second for as long as the job
runs; reading the whole file each time would cost O(file) per refresh, and a
long job's log grows to many megabytes. ``EventTail`` remembers its offset and
parses only the lines appended since. A line without its newline yet (a writer
between ``write`` calls, or killed mid-write) is kept back until it is whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["EventTail"]

_MAX_READ = 64 * 1024 * 1024  # per call: a huge backlog is taken in slices, never all into memory at once


class EventTail:
    """New events of one log since the last ``read``; ``reset`` is set when the file was replaced."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        self.path = p / "events.jsonl" if p.is_dir() else p
        self._offset = 0
        self._partial = b""
        self._inode: int | None = None
        self.skipped = 0  # lines that did not parse as a JSON object
        self.behind = 0  # bytes the last read left for the next one (a backlog over _MAX_READ)

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """Returns (new events, reset). ``reset`` is True when the file shrank or is another file
        than the last read saw: the caller must forget what it built from the old one."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return [], False
        reset = False
        if (self._inode is not None and st.st_ino != self._inode) or st.st_size < self._offset:
            reset = True
            self._offset, self._partial = 0, b""
        self._inode = st.st_ino
        if st.st_size == self._offset:
            self.behind = 0
            return [], reset
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(min(st.st_size - self._offset, _MAX_READ))
        self._offset += len(data)
        self.behind = st.st_size - self._offset
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        events = []
        for line in data[:cut].splitlines():
            if not line.strip():
                continue
            try:
                e = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.skipped += 1  # a torn line left by a writer killed mid-write
                continue
            if isinstance(e, dict):
                events.append(e)
            else:
                self.skipped += 1
        return events, reset
