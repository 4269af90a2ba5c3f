"""Where the monitors' state lives between jobs, and how it travels in checkpoints.

The node agent keeps its computed hang timeouts in
``RUN_DIR/.monitors/timeouts.json`` (``NodeMonitor.save_state``), so a job
started again in the same run directory keeps them. They also go into every
disk checkpoint: rank 0 reads that file when it saves and puts its content in
the checkpoint manifest's extras under ``"monitors"``. A job that resumes from
such a checkpoint (in another run directory, on other machines) hands it back:
the rank that loaded the checkpoint writes it to
``RUN_DIR/.monitors/timeouts-from-checkpoint.json``, and the agent merges
that file into its detector and removes it.

Only JSON moves between the processes; files are written to a temporary name
and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from monitors.safefiles import write_atomic

__all__ = ["CHECKPOINT_EXTRAS_KEY", "monitor_state_path", "offer_from_checkpoint", "offered_state_path",
           "read_monitor_state", "take_offer", "write_json_atomic"]

CHECKPOINT_EXTRAS_KEY = "monitors"


def monitor_state_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / ".monitors" / "timeouts.json"


def offered_state_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / ".monitors" / "timeouts-from-checkpoint.json"


def read_monitor_state(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The agent's last saved state, for a checkpoint; None when there is none or it does not parse."""
    try:
        state = json.loads(monitor_state_path(run_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a side file must never fail a checkpoint
        return None
    return state if isinstance(state, dict) else None


def offer_from_checkpoint(run_dir: str | os.PathLike[str], state: dict[str, Any], *, step: int) -> Path:
    """Hands a checkpoint's monitor state to the agent (it merges and removes the file)."""
    return write_json_atomic(offered_state_path(run_dir), {"step": step, "state": state})


def take_offer(run_dir: str | os.PathLike[str]) -> tuple[int | None, dict[str, Any]] | None:
    """The agent's side of ``offer_from_checkpoint``: ``(step, state)``, or None when nothing is offered.

    The file is removed whatever it holds; one that does not parse raises ``ValueError``.
    """
    path = offered_state_path(run_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    finally:
        path.unlink(missing_ok=True)
    try:
        offer = json.loads(text)
        step, state = offer.get("step"), offer["state"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: the state is not a JSON object")
    return step, state


def write_json_atomic(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())
