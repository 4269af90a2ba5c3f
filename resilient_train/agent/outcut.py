"""A worker's output cut into what the console shows: whole lines, and pieces shown as they are written.

The agent reads each worker's stderr to find its tracebacks, which needs whole
lines; waiting for every line's end, though, held back what a rank shows
without one and let one endless line fill the agent's memory (a 200 MB line
grew it to 570 MB). So:

* a piece with a carriage return and no newline yet (a ``tqdm`` bar:
  ``"\\r 42%|####  |"``) goes out as written, and so does the rest of its
  line, up to its newline;
* a line longer than ``LINE_BOUND`` goes out in pieces of that size: the
  agent never holds more than one bound and one read of a worker's output;
* a traceback that starts on a progress bar's line (Python does not end the
  bar's line before it) is cut from the bar, so it is still found.

:class:`Prefixer` puts ``--tee``'s ``[role+local rank]:`` at the start of
each line of what passes through it, after a bar's carriage returns too.
"""

from __future__ import annotations

import re
from typing import Iterator

__all__ = ["LINE_BOUND", "LineCutter", "Prefixer"]

LINE_BOUND = 64 * 1024  # the longest line held whole (a longer one goes on in pieces of this size)
_TRACEBACK = b"Traceback (most recent call last):"


class LineCutter:
    """Cuts one stream's bytes, as they are read, into ``(data, whole)``: a whole line, or a piece to show as
    it is (``whole`` False). Nothing is held but the start of a line not yet ended, at most ``bound`` bytes."""

    def __init__(self, bound: int = LINE_BOUND) -> None:
        if bound < 1:
            raise ValueError(f"bound {bound}: must be at least 1")
        self._bound = bound
        self._rest = b""
        self._open = False  # a line whose start went out as a piece: the rest of it goes out as it comes

    def feed(self, chunk: bytes) -> list[tuple[bytes, bool]]:
        if not self._rest and not self._open and chunk.endswith(b"\n") and len(chunk) <= self._bound \
                and b"\r" not in chunk:  # whole lines, the usual read: at the cost of a split
            return [(line, True) for line in chunk.splitlines(keepends=True)]  # no "\r" in it: "\n" only
        return list(self._cut(chunk))

    def _cut(self, chunk: bytes) -> Iterator[tuple[bytes, bool]]:
        data = self._rest + chunk if self._rest else chunk
        pos, end, bound = 0, len(data), self._bound
        while pos < end:
            if self._open:
                nl = data.find(b"\n", pos)
                stop = end if nl < 0 else nl + 1
                tb = data.find(_TRACEBACK, pos, stop)
                if tb >= 0:  # the bar's line never ended: end it here, the traceback is a line of its own
                    yield data[pos:tb] + b"\n", False
                    pos, self._open = tb, False
                    continue
                yield data[pos:stop], False
                pos, self._open = stop, nl < 0
                continue
            nl = data.find(b"\n", pos, pos + bound)
            if nl >= 0:
                cr = data.find(b"\r", pos, nl)
                tb = data.find(_TRACEBACK, cr, nl) if cr >= 0 else -1
                if tb >= 0:  # "\r 42%|...Traceback (most recent call last):": the bar, then the traceback
                    yield data[pos:tb] + b"\n", False
                    pos = tb
                    continue
                yield data[pos:nl + 1], True
                pos = nl + 1
            elif end - pos > bound:
                yield data[pos:pos + bound], False
                pos += bound
                self._open = True
            elif data.find(b"\r", pos) >= 0:
                yield data[pos:], False
                pos, self._open = end, True
            else:
                break
        self._rest = data[pos:]

    def close(self) -> bytes:
        """What is left: the start of a line that never ended (the stream closed)."""
        rest, self._rest, self._open = self._rest, b"", False
        return rest


class Prefixer:
    """Puts ``prefix`` at the start of every line of a stream that passes through in pieces."""

    def __init__(self, prefix: bytes) -> None:
        self._prefix = prefix
        self._at_start = True
        self._cr = re.compile(rb"\r(?=[^\n\r])")  # a bar's redraw, not a "\r\n" line end

    def __call__(self, data: bytes) -> bytes:
        if not self._prefix or not data:
            return data
        p = self._prefix
        body = data.replace(b"\n", b"\n" + p)
        if body.endswith(p) and data.endswith(b"\n"):
            body = body[:-len(p)]  # the next line's prefix goes out with it
        body = self._cr.sub(b"\r" + p, body)
        out = p + body if self._at_start else body
        self._at_start = data.endswith(b"\n")
        return out
