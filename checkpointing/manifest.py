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
import math
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpointing.durable import CHECKSUM_ALGORITHM, atomic_write_bytes, file_sha256
from checkpointing.tree import check_skeleton

__all__ = [
    "FORMAT_VERSION", "MANIFEST_FILE", "MAX_CREATED", "MAX_FILE_SIZE", "MAX_JSON_DEPTH", "MAX_MANIFEST_BYTES",
    "MAX_STEP", "MAX_WORLD_SIZE", "CheckpointError", "FileEntry", "Manifest", "is_plain_name", "verify_checkpoint",
]

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
# A manifest is read whole into memory. A skeleton entry costs ~100 bytes, so this holds ~600,000 tensors.
MAX_MANIFEST_BYTES = 64 * 2**20
# JSON nesting: a state's skeleton is 3 levels per level of the state (tree.MAX_DEPTH), plus the envelope.
MAX_JSON_DEPTH = 3 * 64 + 8
_FORMAT_NAME = "resilient-train-checkpoint"
# The ranges of the manifest's numbers. A step and a file size are int64 on disk and in torch; 2**24 ranks is
# past any job (a reader allocates per rank); a creation time is before the year 10000 (what datetime shows).
MAX_STEP = 2**63 - 1
MAX_FILE_SIZE = 2**63 - 1
MAX_WORLD_SIZE = 2**24
MAX_CREATED = 253402300799.0


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
        """Checks every field's type and range: a manifest whose self-checksum matches may still be
        forged, and nothing downstream should meet an infinite size or a list where a mapping belongs.

        The runtime's own numbers are bounded (``MAX_*``). Two parts are other parties' data and are
        checked by their readers: ``extras`` (a mapping; ``extras.monitors`` is checked, number by
        number, by the hang detector that merges it) and the plain values inline in ``tree`` (the
        user's state as saved: a ``float('inf')`` best loss is legitimate there)."""
        if not isinstance(data, dict) or data.get("format") != _FORMAT_NAME:
            raise ValueError("not a resilient-train checkpoint manifest")
        _check_depth(data)
        claimed = data.get("self_checksum")
        body = {k: v for k, v in data.items() if k != "self_checksum"}
        if claimed != _canonical_digest(body):
            raise ValueError("manifest checksum mismatch (torn or edited manifest)")
        version = _int(data, "version", low=0, high=2**31)
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported manifest version {version} (this reader: {FORMAT_VERSION})")
        run_id = data.get("run_id")
        if run_id is not None and not isinstance(run_id, str):
            raise ValueError(f"run_id must be a string or null, got {type(run_id).__name__}")
        created = data.get("created")
        if (isinstance(created, bool) or not isinstance(created, (int, float))
                or (isinstance(created, float) and not math.isfinite(created)) or not 0 <= created <= MAX_CREATED):
            raise ValueError(f"created must be a finite number in [0, {MAX_CREATED:.0f}], got {_show(created)}")
        world_size = _int(data, "world_size", low=1, high=MAX_WORLD_SIZE)
        files = _mapping(data, "files")
        entries = {name: _file_entry(name, e) for name, e in files.items()}
        tree = data.get("tree")
        check_skeleton(tree, "tree")
        local_trees: dict[int, dict[str, Any]] = {}
        for r, t in _mapping(data, "local_trees").items():
            if not (isinstance(r, str) and r.isascii() and r.isdecimal() and len(r) < 10 and int(r) < world_size):
                raise ValueError(f"local_trees: {r[:24]!r} is not a rank of the {world_size} that saved it")
            check_skeleton(t, f"local_trees[{r}]")
            local_trees[int(r)] = t
        return cls(
            step=_int(data, "step", low=0, high=MAX_STEP),
            world_size=world_size,
            run_id=run_id,
            created=float(created),
            files=entries,
            tree=tree,
            local_trees=local_trees,
            extras=_mapping(data, "extras"),
            version=version,
        )

    def write(self, directory: Path) -> None:
        text = json.dumps(self.to_json(), indent=1, allow_nan=True)
        atomic_write_bytes(directory / MANIFEST_FILE, text.encode())

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointError(directory, MANIFEST_FILE, "missing manifest (not a committed checkpoint)") from None
        except OSError as e:  # ELOOP: a symbolic link
            raise CheckpointError(directory, MANIFEST_FILE, f"not a regular file ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(directory, MANIFEST_FILE, "not a regular file")
            if st.st_size > MAX_MANIFEST_BYTES:
                raise CheckpointError(directory, MANIFEST_FILE, f"{st.st_size} bytes, more than a manifest may hold "
                                                                f"({MAX_MANIFEST_BYTES})")
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        finally:
            os.close(fd)
        try:
            return cls.from_json(json.loads(raw.decode("utf-8")))
        except RecursionError:
            raise CheckpointError(directory, MANIFEST_FILE, "invalid manifest: nested too deeply") from None
        except (ValueError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as e:
            raise CheckpointError(directory, MANIFEST_FILE, f"invalid manifest: {e}") from None


def _check_depth(data: Any) -> None:
    """Iteratively: the canonical digest and every reader after it recurse into the data."""
    todo = [(data, 0)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, dict):
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)


def _int(data: dict[str, Any], name: str, *, low: int, high: int) -> int:
    v = data.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {_show(v)}")
    return v


def _show(v: Any) -> str:
    """A value for a one-line message, however large a forged one is."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def _mapping(data: dict[str, Any], name: str) -> dict[str, Any]:
    v = data.get(name)
    if not isinstance(v, dict):
        raise ValueError(f"{name} must be an object, got {type(v).__name__}")
    return v


def _file_entry(name: Any, entry: Any) -> FileEntry:
    if not is_plain_name(name):
        raise ValueError(f"files: {name!r} is not a file name inside the checkpoint directory")
    if not isinstance(entry, dict):
        raise ValueError(f"files[{name!r}] must be an object, got {type(entry).__name__}")
    size, digest = entry.get("size"), entry.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_SIZE:
        raise ValueError(f"files[{name[:60]!r}].size must be an integer in [0, {MAX_FILE_SIZE}], got {_show(size)}")
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise ValueError(f"files[{name!r}].sha256 must be 64 lowercase hex digits")
    return FileEntry(size=size, sha256=digest)


def is_plain_name(name: Any) -> bool:
    """A file directly inside the checkpoint directory: no separator, not ``.`` or ``..``."""
    return isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


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
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CheckpointError(directory, name, "listed in the manifest but missing") from None
        if not stat.S_ISREG(st.st_mode):  # a link could vouch for any file on the machine
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise CheckpointError(directory, name, f"listed in the manifest but {what}")
        if st.st_size != entry.size:
            raise CheckpointError(directory, name, f"size {st.st_size} != {entry.size} in the manifest (truncated?)")
        if checksums:
            _, digest = file_sha256(path, follow=False)
            if digest != entry.sha256:
                raise CheckpointError(directory, name, "checksum mismatch (corrupted)")
    return manifest
