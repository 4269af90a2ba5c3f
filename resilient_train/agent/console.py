"""The agent's stdout and stderr, which every worker's relay shares; a closed one is not a fault of the job.

``resilient-train run ... | head -n 3`` closes the agent's stdout after three
lines. A rank that wrote into that pipe itself got ``BrokenPipeError`` from
its next ``print`` and the runtime retried the job until it stopped. So a
rank's stdout passes through the agent whenever the agent's own stdout is a
pipe or a socket (:attr:`Console.relays_stdout`; a terminal or a file cannot
close under it and is handed to the ranks as is, at no cost), and when the
reader goes, the console says so once: the stream is marked closed, later
writes to it (the agent's, Python's at exit) go to ``/dev/null`` instead of
raising, and ``on_closed`` tells the agent, which sends the ranks' output
to their log files from then on and says where (the ranks never notice).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
import threading
from enum import IntFlag
from typing import IO, Callable

__all__ = ["Console", "Std", "strip_rank_prefix"]

_RANK_PREFIX = re.compile(rb"^\[rank\d+\]:\s?")
INTERRUPT_WAIT_S = 0.5  # how long a KeyboardInterrupt's traceback waits to learn whether Ctrl-C caused it


class Std(IntFlag):
    """torchrun's stream selection: 0 none, 1 stdout, 2 stderr, 3 both."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


class Console:
    """The agent's stdout and stderr: one lock each (a reader that stalls one stalls nothing else), the
    tracebacks shown, and which of the two closed under it."""

    def __init__(self, out: IO[bytes] | None = None, err: IO[bytes] | None = None) -> None:
        # stderr: a copy of fd 2 as it is now, so the ranks' lines go straight to it, not through a pipe the
        # CLI may put on fd 2 later for the agent's own C++ warnings (resilient_train.agent.nativelog.FoldedStderr)
        self._streams = {Std.OUT: out if out is not None else sys.stdout.buffer,
                         Std.ERR: err if err is not None else _copy_of_stderr()}
        self._locks = {Std.OUT: threading.Lock(), Std.ERR: threading.Lock()}
        self._closed = {Std.OUT: False, Std.ERR: False}  # a dict, not an IntFlag: `flag & std` costs 1 us a line
        self.on_closed: Callable[[Std], None] | None = None  # called once per stream, by the writer that found it
        self._shown: dict[tuple[bytes, ...], tuple[int, int]] = {}  # traceback -> (rank, attempt) that showed it
        self._interrupted = threading.Event()  # the agent got SIGINT: a KeyboardInterrupt's traceback is one line

    @property
    def relays_stdout(self) -> bool:
        """Whether the ranks' stdout must pass through the agent: its stdout can close under them (a pipe, a
        socket), or is no file at all; once it closed (a replacement's stdout goes to its log file)."""
        if self._closed[Std.OUT]:
            return True
        try:
            fd = self._streams[Std.OUT].fileno()
        except (OSError, ValueError, AttributeError):  # no file (a test's buffer): only a relay reaches it
            return True
        try:
            mode = os.fstat(fd).st_mode
        except OSError:  # not open: the workers get /dev/null
            return False
        return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)

    def is_closed(self, std: Std) -> bool:
        return self._closed[std]

    def interrupt(self) -> None:
        """The agent received SIGINT (Ctrl-C): the ranks' KeyboardInterrupt tracebacks become one line each."""
        self._interrupted.set()

    def write(self, data: bytes, std: Std = Std.ERR) -> bool:
        """Writes ``data`` to the stream; False once it is closed (its reader went): the caller keeps it."""
        if self._closed[std]:
            return False
        with self._locks[std]:
            if self._closed[std]:
                return False
            stream = self._streams[std]
            try:
                stream.write(data)
                stream.flush()
                return True
            except (BrokenPipeError, ConnectionResetError):
                pass
            except OSError as e:
                if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                    raise
            except ValueError:  # the stream object itself was closed
                pass
            self._closed[std] = True
            _to_null(stream)
        if self.on_closed is not None:
            self.on_closed(std)
        return False

    def closed(self, std: Std) -> None:
        """``std`` was found closed elsewhere (the agent's stderr pump, resilient_train.agent.nativelog)."""
        with self._locks[std]:
            if self._closed[std]:
                return
            self._closed[std] = True
        if self.on_closed is not None:
            self.on_closed(std)

    def traceback(self, block: list[bytes], prefix: bytes, *, rank: int, attempt: int) -> bool:
        """Shows a traceback on stderr, or one line if it was shown before (by another rank or attempt);
        False if stderr is closed."""
        if self._closed[Std.ERR]:
            return False
        key = tuple(strip_rank_prefix(line).rstrip() for line in block)
        # Ctrl-C reaches the ranks and the agent at once: a rank's traceback may come before the agent's
        # handler has run, so a KeyboardInterrupt's waits a moment for it.
        interrupted = key[-1].startswith(b"KeyboardInterrupt") and self._interrupted.wait(INTERRUPT_WAIT_S)
        if interrupted:
            return self.write(prefix + f"[rank{rank}]: interrupted (KeyboardInterrupt)\n".encode())
        first = self._shown.setdefault(key, (rank, attempt))
        if first == (rank, attempt):
            return self.write(b"".join(prefix + line for line in block))
        where = f"rank {first[0]}" + (f" in attempt {first[1]}" if first[1] != attempt else "")
        last = key[-1].decode(errors="replace")
        return self.write(prefix + f"[rank{rank}]: the same traceback as {where}: {last}\n".encode())


def strip_rank_prefix(line: bytes) -> bytes:
    """``line`` without the ``[rankN]:`` torch's excepthook puts before each line once a group exists."""
    return _RANK_PREFIX.sub(b"", line)


def _copy_of_stderr() -> IO[bytes]:
    sys.stderr.flush()
    try:
        return os.fdopen(os.dup(2), "wb")
    except OSError:  # fd 2 is not open: nothing to show the lines on
        return open(os.devnull, "wb")


def _to_null(stream: IO[bytes]) -> None:
    """Later writes to a closed pipe's fd (the agent's own, Python's flush at exit) go nowhere, quietly."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)
