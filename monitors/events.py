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
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from resilient_train.base.safefiles import append_bytes

__all__ = ["MAX_LINE_BYTES", "EventLog", "read_events"]

MAX_LINE_BYTES = 1 << 20  # a longer line is not one of ours (hang stacks are capped at a few KiB)
_WARNED: set[Path] = set()  # the logs this process said it cannot write to (once each: the agent has several)


class EventLog:
    """Appends events to ``path``; ``None`` makes a log that drops everything."""

    def __init__(self, path: str | os.PathLike[str] | None, *, source: str, warn: bool = True,
                 say: Callable[[str], None] | None = None) -> None:
        """``warn``: a failed write is told (once per file and process); a rank under the agent leaves it to
        the agent, which writes to the same file. ``say``: where it is told, one line without the
        ``resilient-train:`` prefix (the agent's console, so that it comes in order with the agent's own lines);
        stderr when None."""
        self.path = Path(path) if path is not None else None
        self.source = source
        self._warn = warn
        self._say = say if say is not None else _to_stderr
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Appends one record. A write that fails (a full disk) is told once on stderr and never raised:
        the log must not take down the party reporting the trouble."""
        record = {"time": time.time(), "event": event, "source": self.source, **fields}
        if self.path is not None:
            line = json.dumps(record, sort_keys=False, default=str) + "\n"
            try:
                append_bytes(self.path, line.encode())
            except OSError as e:
                if self._warn and self.path not in _WARNED:
                    _WARNED.add(self.path)
                    self._say(f"cannot write events to {self.path}: {e.strerror or e}; "
                              "events are dropped while it fails")
        return record


def _to_stderr(line: str) -> None:
    print(f"resilient-train: {line}", file=sys.stderr, flush=True)


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yields the events of a log: JSON objects with a string ``event`` and a numeric ``time``.

    Anything else (a torn last line of a writer killed mid-write, binary junk, a line that is not
    one of our records) is skipped, so readers can rely on those two fields.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "events.jsonl"
    if not p.exists():
        return
    with open(p, "rb") as f:
        while raw := f.readline(MAX_LINE_BYTES + 1):
            if len(raw) > MAX_LINE_BYTES:  # skip the rest of an overlong line without holding it
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(MAX_LINE_BYTES + 1)
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                continue
            if (isinstance(record, dict) and isinstance(record.get("event"), str)
                    and isinstance(record.get("time"), (int, float)) and not isinstance(record["time"], bool)):
                yield record
