"""C++ log lines (c10d's warnings and their stacks), folded to one line each, on the console.

A lost store (node 0's agent gone) makes every TCPStore connection of every
process fail at once, and c10d logs each failure as a warning with the C++
stack of the exception (``Exception raised from ...``, then 20-odd ``frame #N``
lines): 3 to 5 such dumps per node came before the one line that said what
happened. The stack is printed by c10's logger itself, whatever
``TORCH_SHOW_CPP_STACKTRACES`` says (that one governs Python exceptions, whose
text workerio already folds), and ``TORCH_CPP_LOG_LEVEL`` is read only when
torch loads, so the lines are folded where they are read instead:

* a rank's stderr, in the agent (:mod:`resilient_train.agent.workerio`): each C++
  log block becomes its first line, without the stack; a rank's store
  connection warnings are dropped: the store's loss, or its move to another
  agent, is the agent's to say, in one line (a rank whose own link fails
  fails its step, and that is said as the rank's fault);
* the agent's own stderr (:class:`FoldedStderr`, installed by the CLI): its
  store connection warnings are dropped, since each comes with an error the
  agent reports itself; any other block becomes its first line. The console's
  lines (the ranks', the agent's one-line notices) do not pass this way: they
  go straight to the real stderr (resilient_train.agent.console).

Files written by ``--log-dir``/``--tee`` keep every line as it came.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import Any, Callable

from resilient_train.agent.outcut import LINE_BOUND

__all__ = ["FoldedStderr", "NativeLogFolder"]

# c10's log prefix: "[W1202 06:30:13.508153940 TCPStore.cpp:138] " (older: "[W socket.cpp:663] "), after
# the "[rankN]:" torch puts before it once a process group exists.
_HEADER = re.compile(rb"^(?P<prefix>(?:\[rank\d+\]:)?)\[(?P<level>[IWEF])(?:\d{4} [\d:.]+)? *(?P<file>[\w.]+):\d+\] "
                     rb"(?P<message>.*)$")
# The lines of a C++ stack, unmistakable wherever they land (another thread's line may come between two).
_STACK = re.compile(rb"^(?:Exception raised from \S+ at \S+:\d+ \(most recent call first\):"
                    rb"|frame #\d+: .*(?:\(0x[0-9a-f]+ in .*\)|<unknown function>.*)"
                    rb"|<omitting python frames>)$")
_STORE_FILES = (b"tcpstore", b"socket", b"utils.hpp")  # TCPStore.cpp, TCPStoreBackend.cpp, socket.cpp


class NativeLogFolder:
    """Folds the C++ log blocks of one stream and drops its store connection warnings."""

    def __init__(self) -> None:
        self._after_stack = False
        self.folded = 0  # blocks folded or dropped

    def feed(self, line: bytes) -> list[bytes] | None:
        """The lines to show for ``line``: None if it is not part of a C++ log block (show it as it is)."""
        bare = line.rstrip(b"\r\n")
        if _STACK.match(bare):
            self._after_stack = True
            return []
        if self._after_stack:
            self._after_stack = False
            if not bare.strip():
                return []  # the blank line that ends a dump
        m = _HEADER.match(bare)
        if m is None:
            return None
        self.folded += 1
        if m["file"].lower().startswith(_STORE_FILES) and b"[c10d]" in m["message"]:
            return []
        return [bare + b"\n"]


class FoldedStderr:
    """This process's file descriptor 2 through a pipe whose reader folds C++ log blocks.

    Python's own writes to stderr go the same way (and arrive in order with the
    C++ ones). The reader is a daemon thread; ``close`` puts the real stderr back
    and lets it drain what was written before. A real stderr that closes (``2>&1 |
    head``) is told to ``on_closed`` once; what comes after is dropped, and so
    is anything written to fd 2 after ``close`` (it is /dev/null then), so the
    agent's last words cannot raise. A line without an end is passed on in
    pieces of at most ``LINE_BOUND`` bytes.
    """

    def __init__(self, on_closed: Callable[[], None] | None = None) -> None:
        self._folder = NativeLogFolder()
        self._saved: int | None = None
        self._thread: threading.Thread | None = None
        self._on_closed = on_closed
        self.real_closed = False

    def __enter__(self) -> "FoldedStderr":
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        # The reader writes to a copy of its own, closed by itself: one closed here could be reused by then.
        self._thread = threading.Thread(target=self._pump, args=(read_fd, os.dup(self._saved)),
                                        name="rt-native-stderr", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._saved is None:
            return
        try:
            sys.stderr.flush()
        except OSError:
            pass
        os.dup2(self._saved, 2)  # the pipe's last writer here is gone: the reader sees its end
        if self._thread is not None:
            self._thread.join(timeout=2.0)  # a child that inherited fd 2 may hold the pipe open
        if self.real_closed:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)
            os.close(null)
        os.close(self._saved)
        self._saved = None

    def _pump(self, read_fd: int, out_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe, os.fdopen(out_fd, "wb", buffering=0, closefd=True):
            buffer = b""
            while True:
                chunk = pipe.read(65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                out = b"".join(self._show(line + b"\n") for line in lines)
                if len(buffer) > LINE_BOUND:  # a line without an end: on in pieces, not held whole
                    out, buffer = out + buffer, b""
                if out and not self.real_closed:
                    self._write(out_fd, out)
            if buffer and not self.real_closed:
                self._write(out_fd, self._show(buffer))

    def closed(self) -> None:
        """The real stderr was found closed elsewhere: ``close`` leaves /dev/null on fd 2."""
        self.real_closed = True

    def _show(self, line: bytes) -> bytes:
        shown = self._folder.feed(line)
        return line if shown is None else b"".join(shown)

    def _write(self, fd: int, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:  # the real stderr is gone (its reader exited): nothing to show it on
            self.real_closed = True
            if self._on_closed is not None:
                self._on_closed()
