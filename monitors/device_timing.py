"""Section timing on the GPU with CUDA events: what a rank's kernels took, not its launches.

On a GPU the Python code of a step only queues kernels. The wall-clock time of
"forward" is the time to launch it, and the real work shows up wherever the
CPU next waits (a synchronisation in the optimizer, the all-reduce, the step's
end). Scoring stragglers on wall-clock sections would blame the wrong section
and, when every rank waits for the slowest one in a collective, the wrong rank.

``CudaSectionClock`` records one CUDA event on the current stream at every
section change of a timed step. The time between two consecutive events is the section's time
on the device. Events are never waited for: a finished step is queued, and
``ready()`` hands back the steps whose events have all completed (``query()``);
the progress reporter asks at each step boundary, so a step's device times
land in its ring entry one or two steps later. Recording an event costs a few microseconds and needs
no CUPTI.

The progress reporter drives the clock (``monitors.progress``); nothing else
needs to call it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["CudaSectionClock"]

# Steps whose events have not completed yet; beyond this the oldest are dropped
# (a device that stopped making progress, which hang detection handles).
MAX_PENDING = 64


@dataclass
class _Step:
    token: int  # the caller's name for the step (its ring index)
    marks: list[tuple[int, Any]]  # (section code, start event)
    end: Any  # the event that starts the next step


class CudaSectionClock:
    """Per-section device time from CUDA events, read without synchronising.

    Steps are timed on the device when at least ``min_gap_s`` passed since the
    start of the last timed one, so a tiny step pays for its events only now
    and then (about ``1 / min_gap_s`` timed steps a second at most) while a
    step longer than the gap is always timed.
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
        self._gap_ns = int(min_gap_s * 1e9)
        self._last_timed_ns: int | None = None
        self._timing = False  # whether the step in progress is timed
        self._open: list[tuple[int, Any]] = []  # marks of the step in progress
        self._pending: deque[_Step] = deque()
        self._free: list[Any] = []  # events of resolved steps, reused

    def section(self, code: int) -> None:
        """Section ``code`` starts now, within the same step."""
        if self._timing:
            self._open.append((code, self._record()))

    def boundary(self, code: int, now_ns: int, closed: int | None) -> str:
        """A new step starts now with section ``code``.

        ``closed`` names (by its ring index) the step this completes, or is
        ``None`` when the previous step was abandoned (a rollback, the first
        step). Returns what the closed step's device times will be:
        "pending" (queued, see ``ready``), "skipped" (not timed) or "none".
        """
        outcome = "none" if closed is None else "skipped"
        end = None
        if self._timing:
            end = self._record()
            if closed is not None and self._open:
                self._pending.append(_Step(token=closed, marks=self._open, end=end))
                outcome = "pending"
                while len(self._pending) > MAX_PENDING:
                    self._pending.popleft()
        self._timing = self._last_timed_ns is None or now_ns - self._last_timed_ns >= self._gap_ns
        if self._timing:
            self._last_timed_ns = now_ns
            self._open = [(code, end if end is not None else self._record())]
        else:
            self._open = []
        return outcome

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
