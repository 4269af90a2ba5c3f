"""Section timing on the GPU with CUDA events: what a rank's kernels took, not its launches.

On a GPU the Python code of a step only queues kernels. The wall-clock time of
"forward" is the time to launch it, and the real work shows up wherever the
CPU next waits (a synchronisation in the optimizer, the all-reduce, the step's
end). Scoring stragglers on wall-clock sections would blame the wrong section
and, when every rank waits for the slowest one in a collective, the wrong rank.

``CudaSectionClock`` records one CUDA event on the current stream at every
section change of a timed step. The time between two consecutive events is
the section's time on the device. Events are never waited for: a finished
step is queued, and ``ready()`` hands back the steps whose events have all
completed (``query()``); the progress reporter asks at each step boundary, so
a step's device times land in its ring entry one or two steps later.
Recording an event costs a few microseconds and needs no CUPTI.

The progress reporter drives the clock (``monitors.progress``); nothing else
needs to call it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["CudaSectionClock"]

# Steps whose events have not completed yet; beyond this the oldest are dropped
# (a device that stopped making progress, which hang detection handles).
MAX_PENDING = 64
MAX_EVERY = 64  # the sparsest sampling: one step in 64


@dataclass
class _Step:
    token: int  # the caller's name for the step (its ring index)
    marks: list[tuple[int, Any]]  # (section code, start event)
    end: Any  # the event that starts the next step


class CudaSectionClock:
    """Per-section device time from CUDA events, read without synchronising.

    Short steps are sampled to bound the cost: step ``s`` is timed when ``s``
    is a multiple of ``k``, the smallest power of two for which ``k`` steps
    last at least ``min_gap_s`` (from the median of the last 8 steps' wall
    time; steps longer than the gap are all timed). Sampling by step number
    makes the ranks of one job time the same steps; where two ranks' ``k``
    differ, the one with the smaller ``k`` times every step the other times.
    """

    def __init__(self, device: Any, nsections: int, *, min_gap_s: float = 0.05) -> None:
        import torch  # only GPU ranks pay for the import here

        if torch.device(device).type != "cuda":
            raise ValueError(f"CudaSectionClock needs a CUDA device, got {device}")
        if min_gap_s < 0:
            raise ValueError(f"min_gap_s must be >= 0, got {min_gap_s}")
        self._torch = torch
        self._device = torch.device(device)
        self._index = self._device.index if self._device.index is not None else torch.cuda.current_device()
        # The current stream, looked up cheaply by its raw handle; the Stream object is rebuilt only on a change.
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._stream_handle: int | None = None
        self._stream: Any = None
        self._nsections = nsections
        self._gap_ns = min_gap_s * 1e9
        self._recent_ns: deque[int] = deque(maxlen=8)  # wall time of the last steps
        self._last_boundary_ns: int | None = None
        self._timing = False  # whether the step in progress is timed
        self._open: list[tuple[int, Any]] = []  # marks of the step in progress
        self._pending: deque[_Step] = deque()
        self._dropped: list[int] = []  # tokens of queued steps given up on (MAX_PENDING)
        self._free: list[Any] = []  # events of resolved steps, reused

    @property
    def every(self) -> int:
        """Steps are timed when their number is a multiple of this."""
        step_ns = statistics.median(self._recent_ns) if self._recent_ns else 0
        if step_ns <= 0 or step_ns >= self._gap_ns:
            return 1
        return min(MAX_EVERY, 1 << math.ceil(math.log2(self._gap_ns / step_ns)))

    def section(self, code: int) -> None:
        """Section ``code`` starts now, within the same step."""
        if self._timing:
            self._open.append((code, self._record()))

    def boundary(self, code: int, now_ns: int, closed: int | None, step: int) -> str:
        """Step ``step`` starts now with section ``code``.

        ``closed`` names (by its ring index) the step this completes, or is
        ``None`` when the previous step was abandoned (a rollback, the first
        step). Returns what the closed step's device times will be:
        "pending" (queued, see ``ready``), "skipped" (not timed) or "none".
        """
        if closed is not None and self._last_boundary_ns is not None:
            self._recent_ns.append(now_ns - self._last_boundary_ns)
        self._last_boundary_ns = now_ns
        outcome = "none" if closed is None else "skipped"
        end = None
        if self._timing:
            end = self._record()
            if closed is not None and self._open:
                self._pending.append(_Step(token=closed, marks=self._open, end=end))
                outcome = "pending"
                while len(self._pending) > MAX_PENDING:
                    self._dropped.append(self._pending.popleft().token)
        self._timing = step % self.every == 0
        if self._timing:
            self._open = [(code, end if end is not None else self._record())]
        else:
            self._open = []
        return outcome

    def take_dropped(self) -> list[int]:
        """Tokens of queued steps whose events were given up on (their entries say "skipped")."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _record(self) -> Any:
        ev = self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)
        handle = self._raw_stream(self._index) if self._raw_stream is not None else None
        if handle is None or handle != self._stream_handle:
            self._stream = self._torch.cuda.current_stream(self._device)
            self._stream_handle = handle
        ev.record(self._stream)
        return ev

    def ready(self) -> list[tuple[int, list[float]]]:
        """``(token, seconds per section code)`` for queued steps whose events completed, oldest first."""
        out = []
        while self._pending:
            step = self._pending[0]
            if not step.end.query() or not all(ev.query() for _, ev in step.marks):
                break
            self._pending.popleft()
            seconds = [0.0] * self._nsections
            bounds = [ev for _, ev in step.marks] + [step.end]
            for (code, start), end in zip(step.marks, bounds[1:]):
                seconds[code] += start.elapsed_time(end) / 1e3  # milliseconds
            out.append((step.token, seconds))
            self._free.extend(ev for _, ev in step.marks)
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)
