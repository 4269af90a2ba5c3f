"""The recovery timeline: each fault, and where the time to recover from it went.

An incident is one failed generation, as the events tell it:

- ``fault_injected`` (chaos: rank, kind, phase, step), when the fault was planted;
- ``fault_detected``: from the agent (a rank died or was killed as hung:
  rank, how, kind, generation) and from every rank that saw its step fail
  (its own generation, step, phase, error, ``first_reporter``, ``cause``).
  The agent's event may carry the *next* generation: when a survivor
  declared the fault first, the generation had moved before the agent saw the
  exit. An agent event therefore joins an incident whose ranks reported the
  generation before it;
- ``recovery_done`` from each survivor, in the generation it recovered into,
  with the seconds it spent in ``abort``, ``rendezvous`` and ``heal``;
- the next ``step_done``: the first step trained again.

The bar of an incident follows its critical rank, the survivor whose
``recovery_done`` came last: *detect* runs from the injection (else the first
detection) to that rank's own detection, then its abort, rendezvous and heal,
*other* for what its timings do not cover, and *first step* up to the first
``step_done`` after it (or ``first_step_s`` when the event carries it). Every
field is optional: an event without one just leaves that part out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from monitors.stacks import innermost_frame

__all__ = ["SEGMENTS", "build_incidents"]

SEGMENTS = ("detect", "abort", "rendezvous", "heal", "other", "first_step", "recovering")
_JOIN_S = 10.0  # an agent event joins a rank-reported incident that began at most this long before it
_INJECTED_BEFORE_S = 600.0  # a fault planted longer ago than this is not taken as the cause
_UNNAMED_CAUSE_S = 60.0
_AT_ONCE_S = 1.0  # faults planted this close before a detection failed the same generation
_SKEW_S = 0.05  # a detection is never before its fault; this much allows for event times taken in another process
_TOLERATED = ("slow", "nan", "bitflip", "spike")  # kinds that need no new generation


@dataclass
class _Incident:
    detections: list[dict[str, Any]] = field(default_factory=list)
    gens: set[int] = field(default_factory=set)
    injected: list[dict[str, Any]] = field(default_factory=list)

    @property
    def first(self) -> float:
        return min(_t(d) for d in self.detections)

    def agent(self) -> list[dict[str, Any]]:
        return [d for d in self.detections if d.get("source") == "agent"]

    def culprits(self) -> list[int]:
        ranks = sorted({d["rank"] for d in self.agent() if _int(d.get("rank"))})
        if ranks:
            return ranks
        ranks = sorted({d["rank"] for d in self.detections if d.get("first_reporter") is True and _int(d.get("rank"))})
        if ranks:
            return ranks
        causes = [d.get("cause") for d in self.detections if isinstance(d.get("cause"), dict)]
        return sorted({c["rank"] for c in causes if _int(c.get("rank"))})


def build_incidents(ev: dict[str, list[dict[str, Any]]], step_times: list[float], t0: float, now: float,
                    finished: bool) -> list[dict[str, Any]]:
    """Incidents as plain data for the page, oldest first; then the planted faults that needed no recovery."""
    incidents = _group(sorted(ev.get("fault_detected", []), key=_t))
    injections = sorted(ev.get("fault_injected", []), key=_t)
    claimed: set[int] = set()
    for inc in incidents:
        _claim(inc, injections, claimed)
    recoveries = sorted((e for e in ev.get("recovery_done", []) if _int(e.get("generation"))), key=_t)
    out = [_describe(i + 1, inc, recoveries, ev, step_times, t0, now, finished) for i, inc in enumerate(incidents)]
    for j, e in enumerate(injections):
        if j not in claimed:
            out.append(_unmatched(len(out) + 1, e, ev, t0))
    return out


def _group(detections: list[dict[str, Any]]) -> list[_Incident]:
    incidents: list[_Incident] = []
    for d in detections:
        g = d.get("generation") if _int(d.get("generation")) else None
        home = None
        if g is None and incidents and _t(d) - incidents[-1].first <= _JOIN_S:
            home = incidents[-1]  # no generation to go by: the incident just before, if recent
        for inc in reversed(incidents if home is None else []):
            if g is not None and g in inc.gens and not (d.get("source") == "agent" and _has_agent_for(inc, d)):
                home = inc
                break
            if (d.get("source") == "agent" and g is not None and g - 1 in inc.gens and not _has_agent_for(inc, d)
                    and _t(d) - inc.first <= _JOIN_S):
                home = inc
                break
        if home is None:
            home = _Incident()
            incidents.append(home)
        home.detections.append(d)
        if g is not None:
            home.gens.add(g)
    return incidents


def _has_agent_for(inc: _Incident, d: dict[str, Any]) -> bool:
    """The incident already has the agent's word, on another rank: a second death is a second fault,
    unless both fell in the same generation (every rank killed at once)."""
    agent = inc.agent()
    return bool(agent) and all(a.get("generation") != d.get("generation") for a in agent)


def _claim(inc: _Incident, injections: list[dict[str, Any]], claimed: set[int]) -> None:
    """The planted faults behind an incident: the culprits' latest (a hang is detected seconds after it
    was planted), and every other one planted just before the first detection (two faults that hit at
    once fail one generation together)."""
    culprits = set(inc.culprits())
    first = inc.first
    window = [(j, e) for j, e in enumerate(injections)
              if j not in claimed and first - _INJECTED_BEFORE_S <= _t(e) <= first + _SKEW_S
              and e.get("kind") not in _TOLERATED]
    pick: dict[int, dict[str, Any]] = {}
    mine = [(j, e) for j, e in window if e.get("rank") in culprits]
    if mine:
        j, e = mine[-1]
        # Every rank hit by one planted fault (rank: all) is one incident.
        pick.update((k, x) for k, x in mine if x.get("kind") == e.get("kind") and _t(e) - _t(x) <= _AT_ONCE_S)
    pick.update((j, e) for j, e in window if first - _t(e) <= _AT_ONCE_S)
    if not pick and window and first - _t(window[-1][1]) <= _UNNAMED_CAUSE_S:
        # No word on the culprit (no agent: under torchrun a survivor reports first): the fault planted
        # last before it is the likely cause.
        pick[window[-1][0]] = window[-1][1]
    for j in sorted(pick, key=lambda k: _t(injections[k])):
        claimed.add(j)
        inc.injected.append(injections[j])


def _describe(index: int, inc: _Incident, recoveries: list[dict[str, Any]], ev: dict[str, list[dict[str, Any]]],
              step_times: list[float], t0: float, now: float, finished: bool) -> dict[str, Any]:
    first = inc.first
    start = min([_t(e) for e in inc.injected] + [first])
    agent = inc.agent()
    reporter = next((d for d in inc.detections if d.get("first_reporter") is True), None)
    inj = inc.injected[0] if inc.injected else None
    culprits = inc.culprits()
    if inc.injected:  # what was planted names the ranks better than who reported first
        culprits = sorted({e["rank"] for e in inc.injected if _int(e.get("rank"))}
                          | {d["rank"] for d in agent if _int(d.get("rank"))})
    cause = agent[0] if agent else (reporter or inc.detections[0])
    said = [inj, agent[0] if agent else None, reporter]  # who knows the phase and step best, first
    own_error = reporter is not None and reporter.get("rank") in culprits and reporter.get("error")
    seen = next((d for d in inc.detections if d.get("error")), None)
    out: dict[str, Any] = {
        "index": index, "t": round(start - t0, 3), "ranks": culprits, "injected": [_brief(e) for e in inc.injected],
        "kind": "+".join(dict.fromkeys(str(e.get("kind")) for e in inc.injected)) if inj else cause.get("kind"),
        "cause": _cause(cause), "phase": next((e["phase"] for e in said if e and e.get("phase")), None),
        "step": next((e["step"] for e in said if e and e.get("step") is not None), None),
        "generation": min(inc.gens) if inc.gens else None, "detected_by": cause.get("source"),
        "reported": len(inc.detections),
        "error": str(reporter["error"] if own_error else (seen or {}).get("error") or "")[:300] or None,
        "error_from_culprit": bool(own_error),
    }
    top = max(inc.gens) if inc.gens else None
    target = next((e["generation"] for e in recoveries if _t(e) >= first and (top is None or e["generation"] > top)), None)
    done = [e for e in recoveries if e["generation"] == target] if target is not None else []
    if done:
        segments, state = _recovered(inc, done, start, step_times, now, finished, out)
    else:
        segments, state = _unrecovered(first, start, ev, step_times, now, finished, out)
    out["state"] = state
    out["segments"] = [[n, round(v, 4)] for n, v in segments]
    out["total_s"] = round(sum(v for _, v in segments), 4)
    out.update(_hang_details(agent, start, ev))
    out["spawned"] = _replacements(agent, ev)
    return out


def _recovered(inc: _Incident, done: list[dict[str, Any]], start: float, step_times: list[float], now: float,
               finished: bool, out: dict[str, Any]) -> tuple[list[tuple[str, float]], str]:
    """The bar of the critical (last to recover) survivor, from its own detection and timings."""
    crit = max(done, key=_t)
    t_done = _t(crit)
    own = next((d for d in inc.detections if d.get("source") != "agent" and d.get("rank") == crit.get("rank")), None)
    parts = [(n, max(0.0, _num(crit.get(f"{n}_s")))) for n in ("abort", "rendezvous", "heal")]
    spent = sum(v for _, v in parts)
    t_own = _t(own) if own is not None else t_done - spent
    segments = [("detect", max(0.0, t_own - start)), *parts, ("other", max(0.0, t_done - t_own - spent))]
    state = "recovered"
    if _is_num(crit.get("first_step_s")):
        segments.append(("first_step", float(crit["first_step_s"])))
    else:
        k = bisect.bisect_right(step_times, t_done)
        if k < len(step_times):
            segments.append(("first_step", step_times[k] - t_done))
        elif finished:
            state = "recovered (no step after it)"
        else:
            segments.append(("recovering", max(0.0, now - t_done)))
            state = "first step pending"
    out.update({
        "critical_rank": crit.get("rank"), "resume_step": crit.get("resume_step"),
        "replacements": crit.get("replacements"),
        "steps_redone": max((int(e["steps_redone"]) for e in done if _is_num(e.get("steps_redone"))), default=None),
        "reporters": [{k: (round(v, 4) if _is_num(v) else v) for k, v in e.items()
                       if k in ("rank", "detect_s", "abort_s", "rendezvous_s", "heal_s", "first_step_s")}
                      for e in sorted(done, key=lambda e: e.get("rank", 0))],
    })
    return segments, state


def _unrecovered(first: float, start: float, ev: dict[str, list[dict[str, Any]]], step_times: list[float],
                 now: float, finished: bool, out: dict[str, Any]) -> tuple[list[tuple[str, float]], str]:
    """No survivor timed a recovery: still going, resumed from disk (every rank lost), or never."""
    segments = [("detect", max(0.0, first - start))]
    later = [e for e in ev.get("resumed_from_disk", []) if _t(e) >= first]
    if later:
        t_loaded = max(_t(e) for e in later)
        segments.append(("other", max(0.0, t_loaded - first)))
        out["from_disk_step"] = later[0].get("step")
        k = bisect.bisect_right(step_times, t_loaded)
        if k < len(step_times):
            segments.append(("first_step", step_times[k] - t_loaded))
        return segments, "recovered from disk"
    if finished:
        return segments, "not recovered"
    segments.append(("recovering", max(0.0, now - first)))
    return segments, "recovering"


def _hang_details(agent: list[dict[str, Any]], start: float, ev: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What the hang detector saw of the rank the agent killed as hung, and its stacks (taken just before)."""
    out: dict[str, Any] = {}
    for a in agent:
        if a.get("kind") != "hang":
            continue
        rank, t = a.get("rank"), _t(a)
        hangs = [e for e in ev.get("hang_detected", []) if e.get("rank") == rank and start - 1.0 <= _t(e) <= t
                 and not e.get("waiting")]
        if hangs:
            h = hangs[-1]
            out["hang"] = {k: h.get(k) for k in ("section", "step", "since_progress_s", "timeout_s")}
        stacks = [e for e in ev.get("hang_stacks", []) if e.get("rank") == rank and start - 1.0 <= _t(e) <= t + _SKEW_S]
        if stacks:
            text = str(stacks[-1].get("stacks") or "")
            out["stacks"] = text
            out["stuck_in"] = innermost_frame(text)
        return out
    return out


def _replacements(agent: list[dict[str, Any]], ev: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The workers the agent spawned for the ranks it saw die, and how long each took to start its run."""
    out = []
    starts = [e for e in ev.get("run_start", []) if e.get("replacement") is True]
    for a in agent:
        rank, t = a.get("rank"), _t(a)
        sp = next((e for e in ev.get("worker_spawned", []) if e.get("rank") == rank and e.get("replacement") is True
                   and t - _SKEW_S <= _t(e) <= t + _JOIN_S), None)
        if sp is None:
            continue
        st = next((e for e in starts if e.get("pid") == sp.get("pid") and e.get("rank") == rank), None)
        out.append({"rank": rank, "warm": sp.get("warm"), "spare_ready": sp.get("spare_ready"),
                    "started_s": st.get("since_spawn_s") if st else None})
    return out


def _unmatched(index: int, e: dict[str, Any], ev: dict[str, list[dict[str, Any]]], t0: float) -> dict[str, Any]:
    """A planted fault no detection followed: tolerated ones (a slow rank), or one the run never noticed."""
    t = _t(e)
    flagged = next((d for d in ev.get("straggler_detected", []) if d.get("rank") == e.get("rank") and _t(d) >= t), None)
    state = "tolerated" if e.get("kind") in _TOLERATED else "not detected"
    if flagged is not None:
        state = f"flagged as a straggler after {_t(flagged) - t:.1f} s"
    return {"index": index, "t": round(t - t0, 3), "ranks": [e["rank"]] if _int(e.get("rank")) else [],
            "injected": [_brief(e)], "kind": e.get("kind"), "cause": None, "phase": e.get("phase"),
            "step": e.get("step"), "generation": None, "error": None, "detected_by": None, "reported": 0,
            "state": state, "segments": [], "total_s": 0.0, "spawned": []}


def _brief(e: dict[str, Any]) -> dict[str, Any]:
    return {k: e.get(k) for k in ("rank", "kind", "phase", "step")}


def _cause(d: dict[str, Any]) -> str:
    """One line: what the detecting party saw."""
    if d.get("source") == "agent":
        how = d.get("how")
        kind = d.get("kind")
        text = {"exit": "the rank exited", "hang": "killed as hung", "straggler": "replaced as a straggler"}.get(
            str(kind), str(kind or "fault"))
        return f"agent: {text}" + (f" ({how})" if how else "")
    return f"{d.get('source', 'a rank')}: {d.get('kind', 'error')}"


def _first_of(e: dict[str, Any] | None, key: str) -> Any:
    return None if e is None else e.get(key)


def _t(e: dict[str, Any]) -> float:
    return _num(e.get("time"))


def _num(v: Any) -> float:
    return float(v) if _is_num(v) else 0.0


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
