"""The manifest: what makes a step directory a committed checkpoint.

``manifest.json`` names every file of the checkpoint with its size and SHA-256,
the step, the world size that saved it, the run id, the train-state extras and
the JSON skeleton of the state (plain values inline). It carries a checksum of
its own canonical JSON, so a torn or edited manifest is detected too. It is
written last, before the directory is renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpointing.durable import CHECKSUM_ALGORITHM, atomic_write_bytes, file_sha256

__all__ = ["MANIFEST_FILE", "FORMAT_VERSION", "CheckpointError", "FileEntry", "Manifest", "verify_checkpoint"]

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
_FORMAT_NAME = "resilient-train-checkpoint"


class CheckpointError(Exception):
    """A checkpoint directory is not a valid committed checkpoint; ``file`` names the culprit."""

    def __init__(self, directory: Path, file: str | None, reason: str) -> None:
        self.directory = Path(directory)
        self.file = file
        self.reason = reason
        where = f"{self.directory}/{file}" if file else str(self.directory)
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(kw_only=True)
class Manifest:
    """A committed checkpoint's description (see the module docstring)."""

    step: int
    world_size: int
    files: dict[str, FileEntry]
    tree: dict[str, Any]
    local_trees: dict[int, dict[str, Any]] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None
    created: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        body = {
            "format": _FORMAT_NAME,
            "version": self.version,
            "step": self.step,
            "world_size": self.world_size,
            "run_id": self.run_id,
            "created": self.created,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "files": {name: dataclasses.asdict(e) for name, e in sorted(self.files.items())},
            "tree": self.tree,
            "local_trees": {str(r): t for r, t in sorted(self.local_trees.items())},
            "extras": self.extras,
        }
        body["self_checksum"] = _canonical_digest(body)
        return body

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != _FORMAT_NAME:
            raise ValueError("not a resilient-train checkpoint manifest")
        claimed = data.get("self_checksum")
        body = {k: v for k, v in data.items() if k != "self_checksum"}
        if claimed != _canonical_digest(body):
            raise ValueError("manifest checksum mismatch (torn or edited manifest)")
        if data["version"] != FORMAT_VERSION:
            raise ValueError(f"unsupported manifest version {data['version']} (this reader: {FORMAT_VERSION})")
        return cls(
            step=int(data["step"]),
            world_size=int(data["world_size"]),
            run_id=data["run_id"],
            created=float(data["created"]),
            files={n: FileEntry(size=int(e["size"]), sha256=str(e["sha256"])) for n, e in data["files"].items()},
            tree=data["tree"],
            local_trees={int(r): t for r, t in data["local_trees"].items()},
            extras=data["extras"],
            version=int(data["version"]),
        )

    def write(self, directory: Path) -> None:
        text = json.dumps(self.to_json(), indent=1, allow_nan=True)
        atomic_write_bytes(directory / MANIFEST_FILE, text.encode())

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST_FILE
        if not path.is_file():
            raise CheckpointError(directory, MANIFEST_FILE, "missing manifest (not a committed checkpoint)")
        try:
            return cls.from_json(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(directory, MANIFEST_FILE, f"invalid manifest: {e}") from None


def _canonical_digest(body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def verify_checkpoint(
    directory: Path, *, run_id: str | None = None, checksums: bool = True
) -> Manifest:
    """Checks the manifest and every listed file (size, then SHA-256); raises :class:`CheckpointError`.

    With ``run_id`` given, a manifest written by another run is rejected.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(directory, None, "no such checkpoint directory")
    manifest = Manifest.read(directory)
    if run_id is not None and manifest.run_id != run_id:
        raise CheckpointError(
            directory, MANIFEST_FILE, f"manifest belongs to run {manifest.run_id!r}, expected {run_id!r}"
        )
    for name, entry in sorted(manifest.files.items()):
        path = directory / name
        if "/" in name or name.startswith("..") or not path.is_file():
            raise CheckpointError(directory, name, "listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry.size:
            raise CheckpointError(directory, name, f"size {size} != {entry.size} in the manifest (truncated?)")
        if checksums:
            _, digest = file_sha256(path)
            if digest != entry.sha256:
                raise CheckpointError(directory, name, "checksum mismatch (corrupted)")
    return manifest
