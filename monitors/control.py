"""Run-time control of straggler detection: ``RUN_DIR/.monitors/straggler.json``.

Anyone (the CLI, a user with an editor, a test) writes the file; the detector
re-reads it at every report interval, so a change takes effect at the next
report. Writes are atomic (temporary file and rename), so the detector never
reads half a file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient_train.base.safefiles import write_atomic

__all__ = ["StragglerControl", "control_path", "read_control", "write_control"]


@dataclass(frozen=True, kw_only=True)
class StragglerControl:
    """Overrides of ``StragglerConfig``; ``None`` keeps the configured value."""

    enabled: bool | None = None
    threshold: float | None = None


def control_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / ".monitors" / "straggler.json"


def read_control(run_dir: str | os.PathLike[str]) -> StragglerControl:
    """The current overrides; a missing or unreadable file means none, and so does a field of the wrong type
    or out of range (a threshold must be a number in (0, 1], not a bool)."""
    try:
        data: Any = json.loads(control_path(run_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):  # a directory in its place, not JSON: no overrides
        return StragglerControl()
    if not isinstance(data, dict):
        return StragglerControl()
    enabled = data.get("enabled")
    threshold = data.get("threshold")
    return StragglerControl(
        enabled=enabled if isinstance(enabled, bool) else None,
        threshold=float(threshold) if (isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
                                       and 0 < threshold <= 1) else None,
    )


def write_control(
    run_dir: str | os.PathLike[str], *, enabled: bool | None = None, threshold: float | None = None
) -> StragglerControl:
    """Merges the given overrides into the control file and returns the result."""
    if threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    old = read_control(run_dir)
    new = StragglerControl(
        enabled=old.enabled if enabled is None else enabled,
        threshold=old.threshold if threshold is None else threshold,
    )
    path = control_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps({"enabled": new.enabled, "threshold": new.threshold}) + "\n").encode(),
                 fsync=False)
    return new
