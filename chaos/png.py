"""A minimal PNG writer (zlib only) for the step-progress plot: no plotting library needed."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

__all__ = ["Canvas", "progress_plot"]

RGB = tuple[int, int, int]
WHITE, BLACK, GREY, BLUE = (255, 255, 255), (0, 0, 0), (215, 215, 215), (30, 90, 200)
RED, ORANGE, GREEN = (220, 30, 30), (240, 150, 0), (20, 160, 60)


class Canvas:
    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        self.w, self.h = width, height
        self.px = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, c: RGB) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def line(self, x0: int, y0: int, x1: int, y1: int, c: RGB, width: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for k in range(width):
                self.dot(x0 + k, y0, c) if dx < -dy else self.dot(x0, y0 + k, c)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * self.w * y: 3 * self.w * (y + 1)]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def progress_plot(
    path: Path, steps: list[tuple[float, int]], marks: list[tuple[float, RGB]], *, total_s: float, total_steps: int,
    width: int = 900, height: int = 360,
) -> None:
    """Step (y) over seconds since launch (x); a vertical line per mark.

    Grid lines every 10 s (thin) and 60 s (thick) on x, every tenth of the steps on y.
    """
    c = Canvas(width, height)
    left, right, top, bottom = 40, width - 15, 15, height - 30
    xs = max(total_s, 1e-6)
    ys = max(total_steps, 1)

    def X(t: float) -> int:
        return left + int((right - left) * min(max(t, 0.0), xs) / xs)

    def Y(s: float) -> int:
        return bottom - int((bottom - top) * min(max(s, 0), ys) / ys)

    for k in range(1, 11):
        c.line(left, Y(ys * k / 10), right, Y(ys * k / 10), GREY)
    t = 10.0
    while t < xs:
        c.line(X(t), top, X(t), bottom, GREY, 2 if t % 60 == 0 else 1)
        t += 10.0
    for t_mark, colour in marks:
        c.line(X(t_mark), top, X(t_mark), bottom, colour, 2)
    c.line(left, bottom, right, bottom, BLACK, 2)
    c.line(left, top, left, bottom, BLACK, 2)
    last = None
    for t_s, step in steps:
        p = (X(t_s), Y(step))
        if last is not None:
            c.line(last[0], last[1], p[0], p[1], BLUE, 2)
        last = p
    Path(path).write_bytes(c.png())
