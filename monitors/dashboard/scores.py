"""Straggler scores over time, kept small enough for 1,024 ranks.

Each ``straggler_report`` event holds, per rank, a relative and an individual
score and the median time of each section. The history stores them as one
``float32`` matrix per report (metrics x ranks), so a thousand reports of
1,024 ranks cost tens of megabytes, not the gigabyte the parsed JSON would.

A page cannot show 1,024 rows, so every view is aggregated: the heatmap has
the worst ``k`` ranks (lowest score over the window), the distribution has the
minimum, 10th percentile and median of every rank per report, and the flagged
table lists the slowest flagged ranks first.

A section's score is computed like the relative score, per section: the
fastest rank's median time in it over this rank's. It tells *where* a slow
rank loses its time (a slow data loader, a slow GPU in the forward pass).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["K_MAX", "METRICS", "ScoreHistory"]

# Sections with a per-step meaning; start-up, loading, checkpoints and recovery are not scored.
SCORED_SECTIONS = ("data", "forward", "backward", "all-reduce", "optimizer", "between-steps")
METRICS: tuple[str, ...] = ("relative", "individual", *(f"section:{s}" for s in SCORED_SECTIONS))
K_MAX = 64  # rows the heatmap may show; the page picks k <= K_MAX
MAX_REPORTS = 720  # an hour of reports at the default 5 s interval
MAX_COLUMNS = 240  # heatmap columns: older reports are merged (worst score per column)
FLAGGED_ROWS = 64


@dataclass
class _Report:
    interval: int
    t: float  # wall-clock time of the event
    enabled: bool
    threshold: float | None
    control_read_at: float | None
    values: np.ndarray  # [len(METRICS), ranks known then], NaN where a rank was not scored
    scored: int


class ScoreHistory:
    def __init__(self, *, max_reports: int = MAX_REPORTS) -> None:
        self._reports: deque[_Report] = deque(maxlen=max_reports)
        self._col: dict[int, int] = {}  # rank -> column in every values matrix
        self._ranks: list[int] = []
        self.total = 0  # reports seen, including those dropped from the window
        self.last: dict[str, Any] | None = None  # the newest report event
        self.last_scored: dict[str, Any] | None = None  # the newest report that scored a rank
        self.sections_seen: set[str] = set()
        self.detected: list[dict[str, Any]] = []  # straggler_detected events

    def add_report(self, e: dict[str, Any]) -> None:
        scores = e.get("scores") if isinstance(e.get("scores"), dict) else {}
        parsed: list[tuple[int, dict[str, Any]]] = []
        for key, sc in scores.items():
            try:
                rank = int(key)
            except (TypeError, ValueError):
                continue
            if isinstance(sc, dict):
                parsed.append((rank, sc))
        for rank, _ in parsed:
            if rank not in self._col:
                self._col[rank] = len(self._ranks)
                self._ranks.append(rank)
        values = np.full((len(METRICS), len(self._ranks)), np.nan, dtype=np.float32)
        best: dict[str, float] = {}
        for _, sc in parsed:
            for sec, v in _sections(sc).items():
                if v > 0:
                    best[sec] = min(best.get(sec, math.inf), v)
        for rank, sc in parsed:
            c = self._col[rank]
            values[0, c] = _num(sc.get("relative"))
            values[1, c] = _num(sc.get("individual"))
            secs = _sections(sc)
            for i, sec in enumerate(SCORED_SECTIONS, start=2):
                v = secs.get(sec)
                if v is not None and v > 0 and sec in best:
                    values[i, c] = min(1.0, best[sec] / v)
                    self.sections_seen.add(sec)
        self._reports.append(_Report(
            interval=int(e.get("interval", self.total + 1)) if _is_int(e.get("interval")) else self.total + 1,
            t=_num(e.get("time"), 0.0), enabled=e.get("enabled") is not False,
            threshold=_num(e.get("threshold"), None), control_read_at=_num(e.get("control_read_at"), None),
            values=values, scored=len(parsed),
        ))
        self.total += 1
        self.last = e
        if parsed:
            self.last_scored = e

    def add_detected(self, e: dict[str, Any]) -> None:
        if _is_int(e.get("rank")):
            self.detected.append(e)

    @property
    def ranks(self) -> int:
        return len(self._ranks)

    def metrics(self) -> list[str]:
        """The metrics worth offering: both scores, and the sections some report timed."""
        return ["relative", "individual", *(f"section:{s}" for s in SCORED_SECTIONS if s in self.sections_seen)]

    def _matrix(self, metric: str) -> np.ndarray:
        """[reports, ranks] for ``metric``; reports from before a rank appeared are NaN for it."""
        m = METRICS.index(metric)
        out = np.full((len(self._reports), len(self._ranks)), np.nan, dtype=np.float32)
        for i, r in enumerate(self._reports):
            out[i, : r.values.shape[1]] = r.values[m]
        return out

    def heatmap(self, metric: str, t0: float, *, k: int = K_MAX) -> dict[str, Any]:
        """The worst ``k`` ranks over the window, worst first; columns are reports (merged when many)."""
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
        mat = self._matrix(metric)
        times = [r.t - t0 for r in self._reports]
        empty = {"metric": metric, "ranks": [], "worst": [], "t": [], "values": [], "merged": 1, "total_ranks": len(self._ranks)}
        if mat.size == 0:
            return empty
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: ranks or columns never scored
            worst = np.nanmin(mat, axis=0)
            order = np.argsort(np.where(np.isnan(worst), np.inf, worst), kind="stable")[:k]
            order = [int(c) for c in order if not np.isnan(worst[c])]
            merge = max(1, math.ceil(mat.shape[0] / MAX_COLUMNS))
            cols = [np.nanmin(mat[i:i + merge][:, order], axis=0) if order else np.array([])
                    for i in range(0, mat.shape[0], merge)]
        rows = [[_round(col[j]) for col in cols] for j in range(len(order))]
        return {
            "metric": metric, "ranks": [self._ranks[c] for c in order], "worst": [_round(worst[c]) for c in order],
            "t": [round(times[i], 2) for i in range(0, len(times), merge)], "values": rows, "merged": merge,
            "total_ranks": len(self._ranks),
        }

    def distribution(self, metric: str, t0: float) -> dict[str, Any]:
        """Per report, over every rank scored in it: the minimum, 10th percentile and median."""
        mat = self._matrix(metric)
        out: dict[str, Any] = {"t": [round(r.t - t0, 2) for r in self._reports], "min": [], "p10": [], "median": [],
                               "enabled": [r.enabled for r in self._reports]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if mat.size:
                out["min"] = [_round(v) for v in np.nanmin(mat, axis=1)]
                out["p10"] = [_round(v) for v in np.nanpercentile(mat, 10, axis=1)]
                out["median"] = [_round(v) for v in np.nanmedian(mat, axis=1)]
        return out

    def flagged(self, t0: float, threshold: float | None) -> tuple[list[dict[str, Any]], int]:
        """Each rank flagged so far (its first flag), with its newest scores; the slowest now first."""
        latest = (self.last_scored or {}).get("scores", {})
        first: dict[int, dict[str, Any]] = {}
        count: dict[int, int] = {}
        for d in self.detected:
            first.setdefault(int(d["rank"]), d)
            count[int(d["rank"])] = count.get(int(d["rank"]), 0) + 1
        rows = []
        for rank, d in first.items():
            now = latest.get(str(rank), {}) if isinstance(latest, dict) else {}
            rel, ind = _num(now.get("relative"), None), _num(now.get("individual"), None)
            slow = threshold is not None and ((rel is not None and rel < threshold) or (ind is not None and ind < threshold))
            rows.append({
                "rank": rank, "t": round(_num(d.get("time"), t0) - t0, 2), "interval": d.get("interval"),
                "action": d.get("action"), "relative": _num(d.get("relative"), None),
                "individual": _num(d.get("individual"), None), "times": count[rank],
                "now_relative": rel, "now_individual": ind, "slow_now": bool(slow),
                "step_s": _num(now.get("step_s"), None),
            })
        rows.sort(key=lambda r: (not r["slow_now"], r["now_relative"] if r["now_relative"] is not None else 2.0, r["rank"]))
        return rows[:FLAGGED_ROWS], len(rows)

    def reports(self) -> list[_Report]:
        return list(self._reports)


def _sections(sc: dict[str, Any]) -> dict[str, float]:
    secs = sc.get("sections_s")
    if not isinstance(secs, dict):
        return {}
    return {str(k): float(v) for k, v in secs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any, default: Any = math.nan) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return default
    return float(v)


def _round(v: Any) -> float | None:
    return None if v is None or np.isnan(v) else round(float(v), 4)
