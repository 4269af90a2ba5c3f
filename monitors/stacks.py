"""Python stacks of a hung rank, taken just before the agent kills it.

A hang report that says "rank 2, forward, 3 s" tells where the rank stopped
reporting progress, not why. Each supervised rank installs a ``faulthandler``
dump on ``SIGUSR2`` into ``RUN_DIR/.monitors/rank{r}.stacks``: the handler is
C code that reads the interpreter's frames without taking the GIL, so it works
while the main thread spins in C code holding the GIL or blocks in a system
call. The agent sends ``SIGUSR2`` to a hung rank, waits until the dump is
written (two of its polls, at most ``DUMP_WAIT_S``), then sends ``SIGKILL``
and logs the new part of the file.

A stopped process (SIGSTOP) cannot run its handler: the agent sees its state
in ``/proc`` and kills it at once. A rank whose script never installed the
handler (no stacks file, or none written by this process) would die of
``SIGUSR2``'s default action, so it is never sent one. Nor is a rank whose
script had its own ``SIGUSR2`` handler: the dump is then not installed, so as
not to replace it. (``SIGUSR1`` is left to preemption: Slurm's ``--signal``
sends it; resilient_train.rank.preempt.)
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
from pathlib import Path
from typing import IO

from resilient_train.base.safefiles import open_nofollow

__all__ = ["DUMP_WAIT_S", "StackDumps", "innermost_frame", "install_stack_dump", "is_stopped", "stacks_path"]

DUMP_WAIT_S = 0.3  # at most: the agent kills as soon as the dump is written (``StackDumps.written``)
MAX_LOGGED_CHARS = 6000


def stacks_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / ".monitors" / f"rank{rank}.stacks"


def install_stack_dump(run_dir: str | os.PathLike[str], rank: int) -> IO[str] | None:
    """In a rank: dump every thread's stack to its stacks file on SIGUSR2. Keep the returned file open.

    Returns ``None`` (and installs nothing) when the process already handles SIGUSR2, or when the
    stacks file cannot be opened (a symbolic link is never followed).
    """
    if signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None):
        return None
    path = stacks_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # never through a link left at the name: the rank would append its stacks to the link's target
        fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError:
        return None
    f = os.fdopen(fd, "a", buffering=1)  # lives as long as the process
    faulthandler.register(signal.SIGUSR2, file=f, all_threads=True, chain=False)
    f.write(f"# pid {os.getpid()}\n")  # after the handler: the agent signals only a process that wrote this
    return f


def is_stopped(pid: int) -> bool:
    """True when ``pid`` is stopped (SIGSTOP, a debugger): it cannot run a signal handler."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] in (b"T", b"t")


class StackDumps:
    """The agent's side: ask a rank for its stacks and read what it wrote."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = run_dir
        self._offsets: dict[int, int] = {}
        self._sizes: dict[int, int] = {}  # file size at the last ``written`` check

    def request(self, rank: int, pid: int) -> bool:
        """Sends SIGUSR2 when the rank can answer it; False when it cannot (no handler, stopped, gone)."""
        path = stacks_path(self.run_dir, rank)
        try:
            fd = open_nofollow(path, os.O_RDONLY)
        except OSError:  # missing, or a link: nothing this rank installed
            return False
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        # The handler must be this process's: each incarnation appends its pid line once installed.
        if f"# pid {pid}\n".encode() not in data or is_stopped(pid):
            return False
        self._offsets[rank] = len(data)
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            return False
        return True

    def written(self, rank: int) -> bool:
        """True once the rank's dump has been written: the file grew since ``request`` and then stopped
        growing between two calls (faulthandler writes it in one go, well under a millisecond)."""
        offset = self._offsets.get(rank)
        if offset is None:
            return False
        try:
            size = stacks_path(self.run_dir, rank).stat().st_size
        except FileNotFoundError:
            return False
        last, self._sizes[rank] = self._sizes.get(rank), size
        return size > offset and size == last

    def collect(self, rank: int) -> str | None:
        """What the rank wrote since ``request`` (faulthandler's text), trimmed for an event."""
        offset = self._offsets.pop(rank, None)
        self._sizes.pop(rank, None)
        if offset is None:
            return None
        try:
            with open(stacks_path(self.run_dir, rank), "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace").strip()
        except FileNotFoundError:
            return None
        return text[:MAX_LOGGED_CHARS] or None


def innermost_frame(dump: str) -> str | None:
    """``file:line in function`` of the signalled thread's innermost frame in a faulthandler dump."""
    block = dump.split("Current thread", 1)[1] if "Current thread" in dump else dump
    m = re.search(r'File "([^"]+)", line (\d+) in (\S+)', block)
    return f"{m.group(1)}:{m.group(2)} in {m.group(3)}" if m else None
