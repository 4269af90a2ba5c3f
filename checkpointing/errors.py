"""A full disk: the one checkpoint failure that restarting ranks cannot cure.

A rank that dies is replaced; a save that fails is retried at the next
interval. Neither helps when the filesystem is full: every replacement fails
the same write, and the restart budget is spent on a cause nobody is told
about. So a write that ran out of space is classified (:func:`is_disk_full`),
named in one line (:class:`DiskFullError`: the directory, what the write
needed, what was free), and the job is meant to stop with
:data:`EXIT_DISK_FULL` instead of restarting.

torch's serializer reports a failed write as ``unexpected pos N vs M`` and
drops the ``errno``, so a DCP shard write that fails on a filesystem with less
free space than the shard needs is classified as a full disk too
(:func:`disk_full_error`); elsewhere the ``errno`` (``ENOSPC``, ``EDQUOT``)
decides.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from monitors import exitcodes

__all__ = ["EXIT_DISK_FULL", "DiskFullError", "disk_full_error", "free_bytes", "is_disk_full"]

# The exit code of a job stopped by a full disk (monitors.exitcodes: the one table of codes).
EXIT_DISK_FULL = exitcodes.DISK_FULL

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Errors that crossed a process boundary (the writer process, the store) arrive as text.
_FULL_TEXTS = tuple(os.strerror(e) for e in sorted(_FULL_ERRNOS))


class DiskFullError(OSError):
    """A write ran out of space (or quota). ``str()`` is a one-line reason that names the directory."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


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


def is_disk_full(exc: BaseException | None) -> bool:
    """True when ``exc``, or an error it wraps (cause, context, DCP's per-rank failures), is a full disk."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, tuple):  # DCP's failures: {rank: (exception, traceback)} in some versions
            todo.extend(e)
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in _FULL_ERRNOS):
            return True
        if any(text in str(e) for text in _FULL_TEXTS):
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo.extend(failures.values())
    return False


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
