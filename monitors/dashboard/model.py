"""The dashboard's view of a run, built from ``RUN_DIR/events.jsonl`` as it grows.

``RunModel.refresh`` reads only the lines appended since the last call and
folds them in; ``snapshot`` returns plain JSON data for the page (the live
server pushes it, an export embeds it). Events it does not know are counted
and ignored, and every field is optional: the runtime adds fields and events
over time, and an old page must keep working on a new run and the reverse.

Times in a snapshot are seconds since the run's start (the first
``agent_start``, else the first event).
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from monitors.control import read_control
from monitors.dashboard.checkpoints import CheckpointLog
from monitors.dashboard.recovery import build_incidents
from monitors.dashboard.scores import METRICS, ScoreHistory
from monitors.dashboard.tail import EventTail

__all__ = ["RunModel"]

# Events the recovery timeline is built from; kept whole (a run has few of them).
_KEPT = ("fault_injected", "fault_detected", "recovery_done", "hang_detected", "hang_stacks", "resumed_from_disk",
         "straggler_detected")
_RATE_WIDTHS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_RATE_POINTS = 300  # at most, on the step-rate chart
_RATE_NOW_S = 10.0


class RunModel:
    """Thread-safe: the server refreshes it from a worker thread while requests read snapshots."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self._tail = EventTail(self.run_dir / "events.jsonl")
        self._lock = threading.Lock()
        self.version = 0
        self._clear()

    def _clear(self) -> None:
        self._t0: float | None = None
        self._first_t: float | None = None
        self._last_t: float | None = None
        self._agent_starts: list[dict[str, Any]] = []
        self._agent_end: dict[str, Any] | None = None
        self._monitor: dict[str, Any] = {}
        self._world: int | None = None
        self._run_ranks: set[int] = set()
        self._ended_ranks: set[int] = set()
        self._final: dict[str, Any] | None = None
        self._step_t: list[float] = []
        self._step: int | None = None
        self._loss: float | None = None
        self._generation: int | None = None
        self._replacements = 0
        self._kept: dict[str, list[dict[str, Any]]] = {k: [] for k in _KEPT}
        self._spawned: list[dict[str, Any]] = []  # replacements only
        self._replacement_starts: list[dict[str, Any]] = []
        self._controls: list[dict[str, Any]] = []  # changes made from a dashboard
        self._widths: list[dict[str, Any]] = []  # an elastic job's width changes (the ranks' width_changed)
        self.scores = ScoreHistory()
        self.checkpoints = CheckpointLog()
        self.events = 0
        self.unknown: dict[str, int] = {}

    # ------------------------------------------------------------------ input
    def refresh(self) -> bool:
        """Folds in the events appended since the last call; True when anything changed."""
        with self._lock:
            changed = False
            while True:  # a backlog (opening a long run) comes in slices, until caught up
                new, reset = self._tail.read()
                if reset:
                    self._clear()
                for e in new:
                    self._ingest(e)
                changed = changed or bool(new) or reset
                if self._tail.behind <= 0 or not new and not reset:
                    break
            if changed:
                self.version += 1
            return changed

    def _ingest(self, e: dict[str, Any]) -> None:
        self.events += 1
        t = e.get("time")
        if not _is_num(t):
            self.unknown["(no time)"] = self.unknown.get("(no time)", 0) + 1
            return
        t = float(t)
        self._first_t = t if self._first_t is None else min(self._first_t, t)
        self._last_t = t if self._last_t is None else max(self._last_t, t)
        name = str(e.get("event"))
        if name in _KEPT:
            self._kept[name].append(e)
            if name == "straggler_detected":
                self.scores.add_detected(e)
        elif name == "step_done":
            self._step_t.append(t)
            self._step = e.get("step") if _is_int(e.get("step")) else self._step
            self._loss = float(e["loss"]) if _is_num(e.get("loss")) else self._loss
        elif name == "straggler_report":
            self.scores.add_report(e)
        elif name.startswith("checkpoint_"):
            if not self.checkpoints.add(e):
                self.unknown[name] = self.unknown.get(name, 0) + 1
        elif name == "agent_start":
            self._agent_starts.append(e)
            self._agent_end = None
            if self._t0 is None:
                self._t0 = t
            if _is_int(e.get("world_size")):
                self._world = e["world_size"]
        elif name == "agent_end":
            self._agent_end = e
        elif name == "monitor_start":
            self._monitor = e
        elif name == "worker_spawned":
            if e.get("replacement") is True:
                self._replacements += 1
                self._spawned.append(e)
        elif name == "run_start":
            if _is_int(e.get("rank")):
                self._run_ranks.add(e["rank"])
            if _is_int(e.get("world_size")) and self._world is None:
                self._world = e["world_size"]
            if e.get("replacement") is True:
                self._replacement_starts.append(e)
        elif name == "run_end":
            if _is_int(e.get("rank")):
                self._ended_ranks.add(e["rank"])
        elif name == "final_state_written":
            self._final = e
        elif name == "straggler_control":
            self._controls.append(e)
        elif name == "width_changed":
            if _is_int(e.get("processes")) and _is_int(e.get("width")):
                self._widths.append(e)
        else:
            self.unknown[name] = self.unknown.get(name, 0) + 1
        g = e.get("generation")
        if _is_int(g) and name in ("step_done", "recovery_done", "worker_spawned"):
            self._generation = g if self._generation is None else max(self._generation, g)

    # ----------------------------------------------------------------- output
    def snapshot(self, *, metric: str = "relative", all_metrics: bool = False, now: float | None = None) -> dict[str, Any]:
        """The page's data. ``all_metrics`` includes every heatmap (an export cannot ask for another one)."""
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
        with self._lock:
            now = time.time() if now is None else now
            t0 = self._t0 if self._t0 is not None else (self._first_t if self._first_t is not None else now)
            run = self._run_view(t0, now)
            finished = run["state"] != "running" and run["state"] != "no events yet"
            end = (self._last_t or now) if finished else now
            ev = {**self._kept, "worker_spawned": self._spawned, "run_start": self._replacement_starts}
            incidents = build_incidents(ev, self._step_t, t0, end, finished)
            run["faults"] = sum(1 for i in incidents if i["reported"])
            return _finite({
                "version": self.version, "generated_at": now, "run": run,
                "steps": self._steps_view(t0, end, finished),
                "straggler": self._straggler_view(t0, metric, all_metrics),
                "incidents": incidents, "checkpoints": self.checkpoints.view(t0),
                "events": {"total": self.events, "unknown": dict(sorted(self.unknown.items())),
                           "unparsed_lines": self._tail.skipped},
            })

    def _run_view(self, t0: float, now: float) -> dict[str, Any]:
        start = self._agent_starts[-1] if self._agent_starts else {}
        end = self._agent_end
        if self.events == 0:
            state = "no events yet"
        elif end is not None:
            state = "finished" if end.get("ok") is not False else "failed"
        elif not self._agent_starts and self._world and len(self._ended_ranks) >= self._world:
            state = "finished"  # no agent (torchrun): every rank ended its run
        else:
            state = "running"
        last = self._last_t if self._last_t is not None else t0
        return {
            "dir": str(self.run_dir), "state": state, "ok": None if end is None else end.get("ok") is not False,
            "reason": end.get("reason") if end else None, "exit_code": end.get("exit_code") if end else None,
            "started_at": t0, "elapsed_s": round((last if state != "running" else now) - t0, 2),
            "last_event_age_s": round(max(0.0, now - last), 2), "world_size": self._world,
            "script": start.get("script"), "jobs": len(self._agent_starts), "step": self._step,
            "loss": self._loss, "generation": self._generation,
            "restarts": end.get("restarts") if end and _is_int(end.get("restarts")) else self._replacements,
            "final_state": self._final is not None, "ranks_started": len(self._run_ranks),
            "width": {"processes": self._widths[-1]["processes"], "logical": self._widths[-1]["width"],
                      "hosts": self._widths[-1].get("logical", {})} if self._widths else None,
        }

    def _steps_view(self, t0: float, end: float, finished: bool) -> dict[str, Any]:
        times = np.asarray(self._step_t, dtype=np.float64) - t0
        out: dict[str, Any] = {"count": int(times.size), "last": self._step, "rate": {"t": [], "v": []},
                               "rate_now": None, "bucket_s": None,
                               # an elastic job's width changes, marked on the step-rate chart
                               "widths": [{"t": round(float(w["time"]) - t0, 2), "processes": w["processes"],
                                           "logical": w["width"], "cause": str(w.get("cause"))} for w in self._widths]}
        if times.size == 0:
            return out
        span = max(end - t0, 1e-9)
        width = next((w for w in _RATE_WIDTHS if span / w <= _RATE_POINTS), _RATE_WIDTHS[-1])
        counts = np.bincount((np.maximum(times, 0.0) // width).astype(np.int64))
        covered = end - t0 - (len(counts) - 1) * width  # the newest bucket is still filling
        rates = counts / width
        if not finished and covered < width / 2 and len(rates) > 1:
            rates = rates[:-1]
        elif covered > 0:
            rates[-1] = counts[-1] / min(width, covered)
        out["rate"] = {"t": [round((i + 0.5) * width, 2) for i in range(len(rates))], "v": [round(float(v), 3) for v in rates]}
        out["bucket_s"] = width
        recent = times[times >= (end - t0) - _RATE_NOW_S]
        out["rate_now"] = round(recent.size / min(_RATE_NOW_S, max(end - t0 - float(times[0]), 1e-9)), 3) \
            if not finished else round(float(times.size / max(float(times[-1] - times[0]), 1e-9)), 3)
        return out

    def _straggler_view(self, t0: float, metric: str, all_metrics: bool) -> dict[str, Any]:
        s = self.scores
        last = s.last or {}
        cfg = self._monitor.get("straggler") if isinstance(self._monitor.get("straggler"), dict) else {}
        threshold = last.get("threshold") if _is_num(last.get("threshold")) else cfg.get("threshold")
        metrics = s.metrics()
        shown = metrics if all_metrics else [metric]
        ctl = read_control(self.run_dir)
        flagged, flagged_total = s.flagged(t0, threshold if _is_num(threshold) else None)
        controls = self._controls[-1] if self._controls else None
        return {
            "reports": s.total, "ranks": s.ranks, "metrics": metrics, "metric": metric,
            "threshold": threshold,
            "config": {k: cfg.get(k) for k in ("enabled", "threshold", "report_interval_s", "patience", "policy", "scores",
                                               "sections") if k in cfg},
            "reported": {"enabled": last.get("enabled"), "threshold": last.get("threshold"),
                         "interval": last.get("interval"),
                         "t": round(last["time"] - t0, 2) if _is_num(last.get("time")) else None,
                         "control_read_at": last.get("control_read_at")} if last else None,
            "requested": {"enabled": ctl.enabled, "threshold": ctl.threshold,
                          "at": controls.get("time") if controls else None},
            "heatmaps": {m: s.heatmap(m, t0) for m in shown},
            "distribution": {m: s.distribution(m, t0) for m in shown},
            "flagged": flagged, "flagged_total": flagged_total,
        }


def _finite(v: Any) -> Any:
    """NaN and infinities as null: the page parses strict JSON (a NaN loss is a fault, not a crash of the page)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
