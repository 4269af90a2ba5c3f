"""What the benchmarks that drive real agents share: a free port, a run directory's events so far."""

from __future__ import annotations

import json
import socket
from pathlib import Path

__all__ = ["events", "free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the agent binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events(run: Path) -> list[dict]:
    """The events in ``run``'s events.jsonl so far; a line still being written is left out."""
    path = run / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out
