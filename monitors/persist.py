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
and renamed, so a reader never sees half of one. Nothing read back is trusted:
a file must be a regular one of at most :data:`MAX_STATE_BYTES`, and every
number in it is checked by the detector that merges it
(``HangDetector.load_state_dict``), since a checkpoint's extras are whatever
its writer put there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from resilient_train.base.configfile import MAX_COUNT, kind
from resilient_train.base.safefiles import read_regular, write_atomic

__all__ = ["CHECKPOINT_EXTRAS_KEY", "MAX_STATE_BYTES", "monitor_state_path", "offer_from_checkpoint",
           "offered_state_path", "read_json_file", "read_monitor_state", "take_offer", "write_json_atomic"]

CHECKPOINT_EXTRAS_KEY = "monitors"
MAX_STATE_BYTES = 1 << 20  # a saved state is about 1 KiB


def monitor_state_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / ".monitors" / "timeouts.json"


def offered_state_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / ".monitors" / "timeouts-from-checkpoint.json"


def read_monitor_state(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The agent's last saved state, for a checkpoint; None when there is none or it does not parse."""
    try:
        state = read_json_file(monitor_state_path(run_dir))
    except (OSError, ValueError):  # a side file must never fail a checkpoint
        return None
    return state if isinstance(state, dict) else None


def offer_from_checkpoint(run_dir: str | os.PathLike[str], state: dict[str, Any], *, step: int) -> Path:
    """Hands a checkpoint's monitor state to the agent (it merges and removes the file)."""
    return write_json_atomic(offered_state_path(run_dir), {"step": step, "state": state})


def take_offer(run_dir: str | os.PathLike[str]) -> tuple[int | None, dict[str, Any]] | None:
    """The agent's side of ``offer_from_checkpoint``: ``(step, state)``, or None when nothing is offered.

    The file is removed whatever it holds; one that does not parse, or whose step is not an integer
    in [0, ``MAX_COUNT``] (or null), raises ``ValueError``.
    """
    path = offered_state_path(run_dir)
    try:
        offer = read_json_file(path)
    except FileNotFoundError:
        return None
    finally:
        path.unlink(missing_ok=True)
    if not isinstance(offer, dict) or "state" not in offer:
        raise ValueError(f"{path}: not an offer (a mapping with a state)")
    step, state = offer.get("step"), offer["state"]
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_COUNT):
        raise ValueError(f"{path}: step must be an integer in [0, {MAX_COUNT}] or null, got {step!r}")
    if not isinstance(state, dict):
        raise ValueError(f"{path}: the state is not a JSON object (got {kind(state)})")
    return step, state


def read_json_file(path: Path) -> Any:
    """The JSON in ``path``: a regular file of at most :data:`MAX_STATE_BYTES` (not a FIFO or ``/dev/zero``
    behind a link). ``FileNotFoundError`` when there is none; ``ValueError`` (one line) for anything else."""
    try:
        raw, _ = read_regular(path, MAX_STATE_BYTES)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if len(raw) > MAX_STATE_BYTES:
        raise ValueError(f"{path}: over {MAX_STATE_BYTES} bytes; a monitor state is at most {MAX_STATE_BYTES}")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON: {e}") from None


def write_json_atomic(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())
