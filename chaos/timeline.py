"""From a run's events to a timeline per fault (injected, detected, recovered) and goodput."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from chaos.driver import DriverFired
from chaos.schedule import PlannedFault

__all__ = ["FaultTimeline", "Progress", "build_timelines", "progress"]

# A fault is detected by the first event that acts on it: a rank's or the agent's ``fault_detected``
# (recovery starts) or the rerun machine's rejection. A ``hang_detected`` report is not one: a peer
# waiting in a collective on the hung rank is reported long before, and nobody acts on it.
_DETECTIONS = ("fault_detected", "rerun_rejected")
# Kinds that only a particular event detects (a corrupt checkpoint: when a load verifies it).
_DETECTED_BY = {"corrupt-ckpt": ("checkpoint_invalid",), "term": ("preempting",)}
# A SIGTERM is a preemption: the job stops at a boundary after a checkpoint and is started again (the
# driver requeues it, as a scheduler would); it has recovered when the new job trains from that checkpoint.
_REQUEUED_KINDS = frozenset({"term"})
# A stopped or stuck rank is detected when the agent kills it: the agent's fault_detected for that rank.
_HANG_KINDS = frozenset({"hang", "spin", "block", "deadlock"})
_VALUE_KINDS = ("nan", "bitflip", "spike")  # judged by the rerun state machine, mostly without a new generation


@dataclass(kw_only=True)
class FaultTimeline:
    """Times are seconds since the job's launch; None: did not happen."""

    index: int
    label: str
    kind: str
    tolerated: bool
    injected: float | None = None
    detected: float | None = None
    detected_by: str | None = None
    recovered: float | None = None  # every rank trained a step again (or the run finished)
    steps_redone: int | None = None
    step: int | None = None  # where it fired
    detect_timeout_s: float | None = None  # the fault's own limits, when it has them
    recover_timeout_s: float | None = None

    @property
    def detect_s(self) -> float | None:
        return None if self.injected is None or self.detected is None else self.detected - self.injected

    @property
    def recover_s(self) -> float | None:
        return None if self.injected is None or self.recovered is None else self.recovered - self.injected

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "detect_s": self.detect_s, "recover_s": self.recover_s}


@dataclass(frozen=True, kw_only=True)
class Progress:
    steps: list[tuple[float, int]]  # (seconds since launch, step) at each step_done of rank 0
    productive_s: float  # the time of the steps that count, each counted once
    window_s: float  # first step's start to the final state
    goodput: float  # productive_s / window_s


def build_timelines(
    events: list[dict[str, Any]], plan: list[PlannedFault], fired: list[DriverFired], launch: float,
) -> list[FaultTimeline]:
    events = sorted(events, key=lambda e: e["time"])
    injected = [e for e in events if e["event"] == "fault_injected"]
    used: set[int] = set()
    by_index = {d.index: d for d in fired}
    out = []
    for i, f in enumerate(plan):
        tl = FaultTimeline(index=i, label=f.label(), kind=f.kind, tolerated=f.tolerated,
                           detect_timeout_s=f.detect_timeout_s, recover_timeout_s=f.recover_timeout_s)
        end = None
        if f.driver:
            d = by_index.get(i)
            if d is not None:
                tl.injected, end = d.time, d.end
        else:
            hits = _match(injected, f, used)
            if hits:
                tl.injected, tl.step = min(e["time"] for e in hits), hits[0].get("step")
                if f.duration_s is not None:
                    end = tl.injected + f.duration_s
        if tl.injected is not None:
            _follow(tl, f, events, end)
        out.append(_relative(tl, launch))
    return out


def _match(injected: list[dict[str, Any]], f: PlannedFault, used: set[int]) -> list[dict[str, Any]]:
    hits = []
    for ranks_left in [set(f.ranks)]:
        for j, e in enumerate(injected):
            if j in used or e.get("kind") != f.kind or e.get("rank") not in ranks_left or e.get("phase") != f.phase:
                continue
            if f.step is not None and f.phase != "heal" and e.get("step") != f.step:
                continue
            used.add(j)
            ranks_left.discard(e["rank"])
            hits.append(e)
    return hits


def _follow(tl: FaultTimeline, f: PlannedFault, events: list[dict[str, Any]], end: float | None) -> None:
    t0 = tl.injected
    assert t0 is not None
    if tl.tolerated:
        flagged = [e for e in events if e["time"] >= t0 and e["event"] == "straggler_detected" and e.get("rank") in f.ranks]
        if flagged:
            tl.detected, tl.detected_by = flagged[0]["time"], "monitor (straggler)"
        resume = end if end is not None else t0
        tl.recovered = _first_time(events, lambda e: e["event"] in ("step_done", "final_state_written") and e["time"] >= resume)
        if tl.recovered is None:  # the run finished while the fault lasted
            tl.recovered = _first_time(events, lambda e: e["event"] == "final_state_written", after=t0)
        return
    det = next((e for e in events if e["time"] >= t0 and _acts_on(e, f)), None)
    if det is None:
        return
    tl.detected, tl.detected_by = det["time"], f"{det.get('source', '?')} ({det['event']})"
    if f.kind in _VALUE_KINDS and tl.step is not None:
        nxt = next((e for e in events if e["time"] >= tl.detected and e["event"] in ("step_done", "rerun_excluded")
                    and (e["event"] == "rerun_excluded" or e["step"] > tl.step)), None)
        if nxt is not None and nxt["event"] == "step_done":  # re-run in place (or skipped): no new generation
            tl.recovered, tl.steps_redone = nxt["time"], 0
            return
    if f.kind in _REQUEUED_KINDS:
        resumed = next((e for e in events if e["time"] >= tl.detected and e["event"] == "resumed_from_disk"), None)
        if resumed is not None:
            nxt = next((e for e in events if e["time"] >= resumed["time"] and e["event"] == "step_done"), None)
            tl.recovered = nxt["time"] if nxt is not None else _first_time(
                events, lambda e: e["event"] == "final_state_written", after=resumed["time"])
            tl.steps_redone = max(0, (tl.step or 0) - int(resumed["step"]))
        return
    # Recovered: training again in a later generation than the one the fault hit (in process, with a
    # replacement, or from disk alike), or the final state when the fault hit the very end.
    before = [e for e in events if e["event"] == "step_done" and e["time"] < t0]
    g0 = before[-1].get("generation", -1) if before else -1
    nxt = next((e for e in events if e["event"] == "step_done" and e["time"] >= tl.detected
                and e.get("generation", -1) > g0), None)
    if nxt is None:
        tl.recovered = _first_time(events, lambda e: e["event"] == "final_state_written", after=tl.detected)
        return
    tl.recovered = nxt["time"]
    g = nxt.get("generation")
    redone = [int(e.get("steps_redone", 0)) for e in events if e["event"] == "recovery_done" and e.get("generation") == g]
    redone += [max(0, (tl.step or 0) - int(e["step"])) for e in events
               if e["event"] == "resumed_from_disk" and e.get("generation") == g]
    tl.steps_redone = max(redone) if redone else 0


def _acts_on(e: dict[str, Any], f: PlannedFault) -> bool:
    if f.kind in _DETECTED_BY:
        return e["event"] in _DETECTED_BY[f.kind]
    if f.kind in _HANG_KINDS:
        return e["event"] == "fault_detected" and e.get("source") == "agent" and e.get("rank") in f.ranks
    return e["event"] in _DETECTIONS


def _first_time(events: list[dict[str, Any]], pred: Any, after: float = float("-inf")) -> float | None:
    return next((e["time"] for e in events if e["time"] >= after and pred(e)), None)


def _relative(tl: FaultTimeline, launch: float) -> FaultTimeline:
    for name in ("injected", "detected", "recovered"):
        v = getattr(tl, name)
        if v is not None:
            setattr(tl, name, round(v - launch, 4))
    return tl


def progress(events: list[dict[str, Any]], launch: float) -> Progress:
    """Rank 0's step progress and goodput.

    A step's time is the gap between two consecutive ``step_done`` events of
    one generation; a step computed twice (before a fault and again after)
    counts once, at its last computation. Steps right after a (re)start, whose
    time includes the rendezvous, count at the median step time.
    """
    done = sorted((e for e in events if e["event"] == "step_done"), key=lambda e: e["time"])
    if not done:
        return Progress(steps=[], productive_s=0.0, window_s=0.0, goodput=0.0)
    durations: dict[int, float] = {}
    prev = None
    for e in done:
        if prev is not None and e.get("generation") == prev.get("generation") and e["step"] == prev["step"] + 1:
            durations[e["step"]] = e["time"] - prev["time"]
        else:
            durations.pop(e["step"], None)
        prev = e
    median = statistics.median(durations.values()) if durations else 0.0
    final_steps = {e["step"] for e in done}
    productive = sum(durations.get(s, median) for s in final_steps)
    final = next((e["time"] for e in events if e["event"] == "final_state_written"), None)
    end = final if final is not None else max(e["time"] for e in events)
    window = end - done[0]["time"] + durations.get(done[0]["step"], median)
    if final is None:
        productive = 0.0  # a run that never finished produced nothing
    return Progress(
        steps=[(round(e["time"] - launch, 4), int(e["step"])) for e in done],
        productive_s=productive, window_s=window, goodput=productive / window if window > 0 else 0.0,
    )
