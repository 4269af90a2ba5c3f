"""The checkpoint root: ``step-N/`` directories, ``step-N.tmp/`` leftovers, the ``latest`` pointer.

``latest`` is a convenience for people and tools; loading never trusts it alone
and scans for the newest step whose manifest and checksums verify.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from checkpointing.durable import atomic_write_bytes
from checkpointing.manifest import MANIFEST_FILE, CheckpointError, Manifest, verify_checkpoint

__all__ = [
    "LATEST_FILE",
    "StepDir",
    "iter_valid",
    "list_steps",
    "read_latest",
    "step_dir",
    "write_latest",
]

LATEST_FILE = "latest"
_STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True, kw_only=True)
class StepDir:
    step: int
    path: Path
    has_manifest: bool


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def list_steps(root: Path) -> list[StepDir]:
    """Committed-looking step directories (name ``step-N``), oldest first; ``.tmp`` ones are not listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir():
            out.append(StepDir(step=int(m.group(1)), path=child, has_manifest=(child / MANIFEST_FILE).is_file()))
    return sorted(out, key=lambda s: s.step)


def read_latest(root: Path) -> int | None:
    try:
        m = _STEP_RE.match((Path(root) / LATEST_FILE).read_text().strip())
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return int(m.group(1)) if m else None


def write_latest(root: Path, step: int) -> None:
    atomic_write_bytes(Path(root) / LATEST_FILE, f"step-{step}\n".encode())


def iter_valid(
    root: Path, *, run_id: str | None = None, below: int | None = None
) -> Iterator[tuple[StepDir, Manifest | CheckpointError]]:
    """Newest first: each step directory with its verified manifest, or the error that disqualifies it."""
    for entry in reversed(list_steps(root)):
        if below is not None and entry.step >= below:
            continue
        try:
            manifest = verify_checkpoint(entry.path, run_id=run_id)
            if manifest.step != entry.step:
                raise CheckpointError(entry.path, MANIFEST_FILE, f"manifest says step {manifest.step}")
            yield entry, manifest
        except CheckpointError as e:
            yield entry, e
