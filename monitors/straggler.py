"""Straggler scores from the per-step timings in the progress slots.

Every ``report_interval_s`` the detector takes the steps each rank completed
since the last report and computes, over the rank's own work (``sections``,
by default data + forward + backward + optimizer, so time spent waiting for
peers in a collective does not count), timed on the device with CUDA events
on a GPU rank and by the wall clock otherwise (``monitors.device_timing``):

- relative score = the best rank's median / this rank's median (the best of
  the whole job when the agents of many nodes share theirs: ``monitors.jobwide``);
- individual score = this rank's best interval median so far / its current one.

A rank is flagged when a score named in ``scores`` stays below ``threshold``
for ``patience`` consecutive intervals. The decision carries the policy's
action ("log" or "replace"); the agent acts on it. ``enabled`` and
``threshold`` can be overridden at run time through ``monitors.control``.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Iterable

from resilient_train.base.configfile import (
    MAX_COUNT, MAX_SECONDS, require_bool, require_int, require_number, require_strs,
)
from monitors.control import read_control
from monitors.jobwide import JobWideBest
from monitors.progressreader import ProgressReader
from monitors.sections import COMPUTE_SECTIONS, SECTIONS

__all__ = ["RankScore", "StragglerConfig", "StragglerDecision", "StragglerDetector", "StragglerReport"]

POLICIES = ("log", "replace")
SCORES = ("relative", "individual")


@dataclass(kw_only=True)
class StragglerConfig:
    enabled: bool = True  # steered at run time too: resilient-train straggler RUN_DIR --on/--off
    threshold: float = 0.75  # a score below this counts as slow
    report_interval_s: float = 5.0  # scores are computed and reported this often
    patience: int = 2  # intervals in a row below the threshold before a rank is flagged
    min_steps: int = 3  # steps a rank must complete in an interval to be scored
    policy: str = "log"  # a flagged rank: "log" it, or "replace" it
    sections: tuple[str, ...] = COMPUTE_SECTIONS  # a rank's own work, timed (not its waits for peers)
    scores: tuple[str, ...] = ("relative",)  # relative (to the fastest rank), individual (to its own best)

    def __post_init__(self) -> None:
        require_bool(self.enabled, "straggler.enabled")
        require_number(self.threshold, "straggler.threshold", above=0, high=1)
        require_number(self.report_interval_s, "straggler.report_interval_s", above=0, high=MAX_SECONDS)
        require_int(self.patience, "straggler.patience", low=1, high=MAX_COUNT)
        require_int(self.min_steps, "straggler.min_steps", low=1, high=MAX_COUNT)
        if self.policy not in POLICIES:
            raise ValueError(f"straggler.policy must be one of {list(POLICIES)}, got {self.policy!r}")
        self.sections = require_strs(self.sections, "straggler.sections", choices=SECTIONS)
        self.scores = require_strs(self.scores, "straggler.scores", choices=SCORES)
        if not self.sections or not self.scores:
            raise ValueError("straggler.sections and straggler.scores must not be empty")


@dataclass(frozen=True, kw_only=True)
class RankScore:
    rank: int
    steps: int  # steps completed in this interval
    last_step: int
    step_s: float  # median step time (wall clock)
    work_s: float  # median time in the scored sections
    sections_s: dict[str, float]  # median per section
    clock: str  # what timed the sections: "cuda" (events on the device) or "wall"
    relative: float
    individual: float
    intervals_below: int


@dataclass(frozen=True, kw_only=True)
class StragglerDecision:
    rank: int
    action: str  # "log" or "replace"
    relative: float
    individual: float
    intervals_below: int
    new: bool  # first interval this rank is flagged (act once on it)


@dataclass(frozen=True, kw_only=True)
class StragglerReport:
    interval: int
    time: float  # monotonic seconds
    control_read_at: float  # wall-clock time the run-time control was read for this report
    enabled: bool
    threshold: float
    scores: dict[int, RankScore]
    flagged: list[StragglerDecision]
    job_best_s: float | None = None  # the fastest median the relative scores were taken against (every node's)
    job_nodes: int = 1  # nodes that took part in it


class StragglerDetector:
    """Polled by the node agent; reads the ranks' progress slots, never blocks."""

    def __init__(self, config: StragglerConfig, run_dir: str | os.PathLike[str], ranks: Iterable[int], *,
                 peers: JobWideBest | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.peers = peers  # many nodes: relative scores against the whole job's fastest rank (monitors.jobwide)
        self._readers = {r: ProgressReader(run_dir, r) for r in ranks}
        self._cursor: dict[int, tuple[tuple[int, int, int], int]] = {}
        self._best: dict[int, float] = {}
        self._below: dict[int, int] = {}
        self._interval = 0
        self._next = time.monotonic() + config.report_interval_s
        self.last: StragglerReport | None = None

    def reset(self, rank: int) -> None:
        """``rank`` was replaced: forget its history."""
        if rank not in self._readers:
            self._readers[rank] = ProgressReader(self.run_dir, rank)
        self._best.pop(rank, None)
        self._below.pop(rank, None)

    def remove(self, rank: int) -> None:
        reader = self._readers.pop(rank, None)
        if reader is not None:
            reader.close()
        for d in (self._cursor, self._best, self._below):
            d.pop(rank, None)

    def poll(self, now: float | None = None) -> StragglerReport | None:
        """A report when an interval has elapsed since the last one, else ``None``."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + self.config.report_interval_s
        return self.report(now)

    def report(self, now: float | None = None) -> StragglerReport:
        """Scores the steps completed since the previous report."""
        now = time.monotonic() if now is None else now
        read_at = time.time()
        ctl = read_control(self.run_dir)
        enabled = self.config.enabled if ctl.enabled is None else ctl.enabled
        threshold = self.config.threshold if ctl.threshold is None else ctl.threshold
        self._interval += 1
        fresh = self._collect()
        if not enabled:
            self._below.clear()
            self.last = StragglerReport(interval=self._interval, time=now, control_read_at=read_at, enabled=False,
                                        threshold=threshold, scores={}, flagged=[])
            return self.last
        medians = {}
        for rank, records in fresh.items():
            if len(records) >= self.config.min_steps:
                work = [sum(r.timed_sections_s[s] for s in self.config.sections) for r in records]
                medians[rank] = (records, statistics.median(work))
        best = min((m for _, m in medians.values()), default=0.0)
        compared, job_nodes = len(medians), 1
        if self.peers is not None:
            job = self.peers.exchange(best if medians else None, len(medians))
            if job is not None and job.best_s is not None:
                best, compared, job_nodes = min(best, job.best_s) if medians else job.best_s, job.ranks, job.nodes
        scores: dict[int, RankScore] = {}
        flagged: list[StragglerDecision] = []
        for rank, (records, work_s) in sorted(medians.items()):
            relative = _ratio(best, work_s)
            self._best[rank] = min(self._best.get(rank, work_s), work_s)
            individual = _ratio(self._best[rank], work_s)
            values = {"relative": relative, "individual": individual}
            # A rank scored alone has no one to be compared with: its relative score says nothing.
            judged = [s for s in self.config.scores if s != "relative" or compared >= 2]
            rose = any(values[s] < threshold for s in judged)
            if rose:
                self._below[rank] = self._below.get(rank, 0) + 1
            elif judged:
                self._below[rank] = 0
            below = self._below.get(rank, 0)
            scores[rank] = RankScore(
                rank=rank, steps=len(records), last_step=records[-1].step,
                step_s=statistics.median(r.step_s for r in records), work_s=work_s,
                sections_s={s: statistics.median(r.timed_sections_s[s] for r in records) for s in SECTIONS},
                clock="cuda" if records[-1].device_sections_s is not None else "wall",
                relative=relative, individual=individual, intervals_below=below,
            )
            if below >= self.config.patience:
                flagged.append(StragglerDecision(
                    rank=rank, action=self.config.policy, relative=relative, individual=individual,
                    intervals_below=below, new=rose and below == self.config.patience,
                ))
        self.last = StragglerReport(interval=self._interval, time=now, control_read_at=read_at, enabled=True,
                                    threshold=threshold, scores=scores, flagged=flagged,
                                    job_best_s=best if medians or job_nodes > 1 else None, job_nodes=job_nodes)
        return self.last

    def _collect(self) -> dict[int, list]:
        out = {}
        for rank, reader in self._readers.items():
            snap = reader.read()
            if snap is None:
                continue
            ident, seen = self._cursor.get(rank, (None, 0))
            if ident != snap.identity:
                seen = 0
            records = reader.steps(snap, seen)
            # A GPU step is scored once its CUDA events completed: stop at the first still pending.
            done = next((i for i, r in enumerate(records) if r.device_pending), len(records))
            # Steps a GPU rank did not time on the device are not scored: wall and device times do not mix.
            out[rank] = [r for r in records[:done] if not r.device_skipped]
            self._cursor[rank] = (snap.identity, snap.steps_done - (len(records) - done))
        return out

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


def _ratio(num: float, den: float) -> float:
    if den <= 0:
        return 1.0
    return min(1.0, num / den)
