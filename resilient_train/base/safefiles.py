"""Creating files in a run directory without following links someone placed there.

Every party of a run writes into the run directory: the agent, each rank, the
checkpoint writer, the CLI. A symbolic link left under a name one of them
writes (``.monitors/rank1.stacks`` pointing at ``~/.bashrc``) would have that
party write through it, with its rights. Here the last path component is
opened with ``O_NOFOLLOW`` (a link fails with ``ELOOP``), temporaries are
created with ``O_EXCL`` (never an existing file), and a temporary replaces its
target with ``rename``, which replaces a link itself, not what it points to.
The directories above are the run directory's business (``resilient_train.agent.rundir``:
private to its owner).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["FILE_MODE", "append_bytes", "create_exclusive", "open_nofollow", "read_regular", "writable_dir",
           "write_atomic"]

FILE_MODE = 0o644  # the run directory itself is 0o700: its files need no tighter mode to be private
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = FILE_MODE) -> int:
    """``os.open`` that refuses a symbolic link as the last component (``OSError`` with ``ELOOP``)."""
    return os.open(path, flags | _NOFOLLOW, mode)


def read_regular(path: str | os.PathLike[str], max_bytes: int, *,
                 follow_links: bool = True) -> tuple[bytes, os.stat_result]:
    """At most ``max_bytes + 1`` bytes of ``path`` (a caller sees a longer file as too long) and its status.

    Only a regular file is read: a FIFO, a device (``/dev/zero`` behind a link)
    or a directory is refused before a byte is read, and the open never blocks.
    ``follow_links=False`` refuses a link as the last component too.
    ``FileNotFoundError`` when nothing is there; ``ValueError`` with the reason
    (no path: the caller names the file) for the rest.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ValueError(f"cannot be read: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        return f.read(max_bytes + 1), st


def create_exclusive(path: str | os.PathLike[str], mode: int = FILE_MODE) -> int:
    """A new file for writing, opened read-write; a leftover at ``path`` (ours, from a crash) is removed first.

    ``O_EXCL`` never opens what is already there, a link included.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> Path:
    """Replaces ``path`` by ``data`` (a temporary beside it, then a rename): readers see the old or the
    new file, never a torn one, and a link at ``path`` is replaced, not written through."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = create_exclusive(tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if fsync:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


def append_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Appends ``data`` with one ``write`` (lines from several processes never interleave).

    A write the filesystem cut short (it filled up) is taken back (the file is truncated to where the write
    began) and raises ``ENOSPC``: a reader never finds half a record, nor the next record glued to it."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        n = os.write(fd, data)
        if n < len(data):
            try:
                os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR) - n)
            except OSError:
                pass
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a short write to {path}, taken back)")
    finally:
        os.close(fd)


def writable_dir(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a directory this process can create files in (made now), or ``ValueError`` naming
    ``what`` (a command-line flag): a path that is a file must fail before any job starts, in one line."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600))
        os.unlink(probe)
    except FileExistsError:
        raise ValueError(f"{what} {str(p)!r} exists and is not a directory") from None
    except OSError as e:
        raise ValueError(f"{what} {str(p)!r} is not a writable directory: {e.strerror or e}") from None
    return p
