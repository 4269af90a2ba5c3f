"""The run's event log: ``RUN_DIR/events.jsonl``, one JSON object per line.

Every party of a run (the agent and each rank) appends to the same file. Each
record is written with a single ``write`` on a file opened in append mode, so
lines from different processes never interleave (POSIX appends of one buffer
under ``PIPE_BUF``-sized records are atomic on local file systems; larger ones
are still written whole by one call on Linux for regular files).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["EventLog", "read_events"]


class EventLog:
    """Appends events to ``path``; ``None`` makes a log that drops everything."""

    def __init__(self, path: str | os.PathLike[str] | None, *, source: str) -> None:
        self.path = Path(path) if path is not None else None
        self.source = source
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, "source": self.source, **fields}
        if self.path is not None:
            line = json.dumps(record, sort_keys=False, default=str) + "\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        return record


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yields the events of a log; a torn last line (a writer killed mid-write) is skipped."""
    p = Path(path)
    if p.is_dir():
        p = p / "events.jsonl"
    if not p.exists():
        return
    with open(p, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
