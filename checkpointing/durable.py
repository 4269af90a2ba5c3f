"""Durable file operations: fsync'd writes, atomic replacement, checksums.

Everything the commit protocol relies on for crash safety lives here, so the
ordering rules (write, fsync the file, rename, fsync the parent) are in one place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from resilient_train.base.safefiles import create_exclusive

__all__ = [
    "CHECKSUM_ALGORITHM",
    "atomic_write_bytes",
    "file_sha256",
    "fsync_dir",
    "fsync_file",
    "remove_tree",
]

CHECKSUM_ALGORITHM = "sha256"
_CHUNK = 8 * 1024 * 1024


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Makes renames and creations inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replaces ``path`` by ``data`` so that readers see the old or the new file, never a torn one.

    The temporary is created with ``O_EXCL | O_NOFOLLOW``: a link placed at its name is never written through.
    """
    tmp = path.with_name(path.name + ".tmp")
    fd = create_exclusive(tmp)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
            f.flush()
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_sha256(path: Path, *, follow: bool = True) -> tuple[int, str]:
    """Returns ``(size, hex digest)`` of a file, read in chunks; ``follow=False`` refuses a symbolic link."""
    h = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    with open(fd, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def remove_tree(path: Path) -> None:
    """Deletes a directory tree; a concurrent deletion of the same tree is not an error.

    A symbolic link is removed itself: what it points to is never touched.
    """
    if os.path.islink(path):
        os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)
