"""Storage faults: the checkpoint failures that restarting ranks cannot cure.

A rank that dies is replaced; a save that fails is retried at the next
interval. Neither helps when the storage itself is the trouble: every
replacement fails the same write, and the restart budget is spent on a cause
nobody is told about. So a write that failed for the storage is classified
(:func:`storage_fault`), named in one line, and the job is meant to stop with
its exit code instead of restarting:

* **full** (``ENOSPC``, ``EDQUOT``): :class:`DiskFullError`, exit
  :data:`~resilient_train.base.exitcodes.DISK_FULL` (28);
* **unwritable** (``EROFS``: remounted read-only; ``EIO``: the device fails;
  ``ESTALE``: a network filesystem lost the directory): :class:`UnwritableError`,
  exit :data:`~resilient_train.base.exitcodes.STORAGE` (74, EX_IOERR).

torch's serializer reports a failed write as ``unexpected pos N vs M`` and
drops the ``errno``, so a DCP shard write that fails on a filesystem with less
free space than the shard needs is classified as a full disk too
(:func:`disk_full_error`); elsewhere the ``errno`` decides, or its text when
the error crossed a process boundary (the writer process, the store).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from resilient_train.base import exitcodes

__all__ = ["EXIT_DISK_FULL", "FULL", "UNWRITABLE", "DiskFullError", "StorageError", "UnwritableError",
           "disk_full_error", "free_bytes", "is_disk_full", "storage_error", "storage_error_for", "storage_fault",
           "storage_stop"]

# The exit code of a job stopped by a full disk (resilient_train.base.exitcodes: the one table of codes).
EXIT_DISK_FULL = exitcodes.DISK_FULL

FULL, UNWRITABLE = "full", "unwritable"
_ERRNOS = {errno.ENOSPC: FULL, errno.EDQUOT: FULL, errno.EROFS: UNWRITABLE, errno.EIO: UNWRITABLE,
           errno.ESTALE: UNWRITABLE}
# Errors that crossed a process boundary (the writer process, the store) arrive as text.
_TEXTS = tuple((os.strerror(e), kind) for e, kind in sorted(_ERRNOS.items()))


class StorageError(OSError):
    """A write failed for the storage. ``str()`` is a one-line reason that names the directory."""

    kind = ""
    exit_code = exitcodes.FAILED

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class DiskFullError(StorageError):
    """A write ran out of space (or quota)."""

    kind = FULL
    exit_code = exitcodes.DISK_FULL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC


class UnwritableError(StorageError):
    """The storage refuses writes: remounted read-only, failing I/O, or gone from under the run."""

    kind = UNWRITABLE
    exit_code = exitcodes.STORAGE


def storage_error(kind: str, message: str) -> StorageError:
    """The error of ``kind`` (:data:`FULL` or :data:`UNWRITABLE`) saying ``message``."""
    return DiskFullError(message) if kind == FULL else UnwritableError(message)


def storage_fault(exc: BaseException | None) -> str | None:
    """:data:`FULL` or :data:`UNWRITABLE` when ``exc``, or an error it wraps (cause, context, DCP's per-rank
    failures), is a storage fault; else None. A full disk wins over the rest (it is the common one)."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    found: str | None = None
    while todo:
        e = todo.pop()
        if isinstance(e, tuple):  # DCP's failures: {rank: (exception, traceback)} in some versions
            todo.extend(e)
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        kind = e.kind if isinstance(e, StorageError) else (
            _ERRNOS.get(e.errno) if isinstance(e, OSError) and e.errno is not None else None)
        kind = kind or next((k for text, k in _TEXTS if text in str(e)), None)
        if kind == FULL:
            return FULL
        found = found or kind
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo.extend(failures.values())
    return found


def is_disk_full(exc: BaseException | None) -> bool:
    """True when ``exc``, or an error it wraps, is a full disk."""
    return storage_fault(exc) == FULL


def storage_stop(exc: BaseException | None) -> int | None:
    """The exit code a job stops with for ``exc``, when it is a storage fault no restart cures: a full disk
    anywhere, or a :class:`StorageError` the runtime raised for its own files (checkpoints, the final state,
    progress slots). A read-only or failing filesystem met by the user's own code (a data read, say) is left to
    the usual judgement: it may be transient (an NFS hiccup), and a bug repeats."""
    kind = storage_fault(exc)
    if kind == FULL:
        return exitcodes.DISK_FULL
    seen: set[int] = set()
    e: object = exc
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, StorageError):
            return e.exit_code
        todo += [e.__cause__, e.__context__]
    return None


def storage_error_for(directory: str | os.PathLike[str], exc: BaseException, *, what: str) -> StorageError | None:
    """A :class:`StorageError` naming ``directory`` when ``exc`` (met ``what``: "writing X") is a storage fault;
    None otherwise (``exc`` itself when it is one already)."""
    if isinstance(exc, StorageError):
        return exc
    kind = storage_fault(exc)
    if kind == FULL:
        return disk_full_error(directory, exc, what=what)
    if kind == UNWRITABLE:
        reason = getattr(exc, "strerror", None) or str(exc)
        return UnwritableError(f"cannot write to {directory} {what}: {reason} (read-only, failing, or gone)")
    return None


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes this process may still write on ``path``'s filesystem (its nearest existing ancestor's);
    None when it cannot be told. Root may use the blocks reserved for it, others may not."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize


def disk_full_error(
    directory: str | os.PathLike[str], exc: BaseException | None, *, needed: int | None = None, what: str = "writing"
) -> DiskFullError | None:
    """A :class:`DiskFullError` naming ``directory`` when ``exc`` is a full disk, or (with ``needed``, the
    bytes the failed write was to produce) when the filesystem has less than that free; else None."""
    free = free_bytes(directory)
    short = needed is not None and free is not None and free < needed
    if not (is_disk_full(exc) or short):
        return None
    parts = [f"needed {_size(needed)}" if needed is not None else "", f"{_size(free)} free" if free is not None else ""]
    detail = ", ".join(p for p in parts if p)
    return DiskFullError(f"disk full: no space left on the device holding {directory} {what}" + (f" ({detail})" if detail else ""))


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
