"""The invariants of a scenario, checked against a finished run."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chaos.driver import JobRun
from chaos.scenario import Invariants
from chaos.timeline import FaultTimeline

__all__ = ["Check", "check_invariants"]


@dataclass(frozen=True, kw_only=True)
class Check:
    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_invariants(
    inv: Invariants, run: JobRun, reference_final: Path | None, timelines: list[FaultTimeline], *, timeout_s: float,
) -> list[Check]:
    checks: list[Check] = []
    final = run.run_dir / "final"
    finished = run.returncode == 0 and (final / "manifest.json").is_file()
    if inv.completes:
        if run.timed_out:
            detail = f"no end after {timeout_s:g} s: the job was killed"
        elif run.returncode != 0:
            last = run.log_tail(1).strip()
            detail = f"exit code {run.returncode}" + (f": {last[:300]}" if last else "")
        else:
            detail = "exit 0 with a final state" if finished else "exit 0 but no final state written"
        checks.append(Check(name="completes", ok=finished, detail=detail))
    if inv.bitwise:
        checks.append(_bitwise(final, reference_final))
    if inv.valid_latest:
        ok = not run.latest_violations
        detail = "; ".join(run.latest_violations[:3]) if not ok else (
            f"{run.latest_checked} checkpoint(s) verified as they became latest" if run.latest_checked
            else "no checkpoint was written")
        checks.append(Check(name="valid_latest", ok=ok, detail=detail))
    fired = [t for t in timelines if t.injected is not None]
    if inv.min_faults:
        missing = [t.label for t in timelines if t.injected is None]
        checks.append(Check(name="min_faults", ok=len(fired) >= inv.min_faults,
                            detail=f"{len(fired)} of {len(timelines)} planned faults fired (need {inv.min_faults})"
                            + (f"; never fired: {', '.join(missing[:5])}" if missing else "")))
    if inv.recovered:
        checks.extend(_recovery_checks(inv, timelines, fired))
    return checks


def _bitwise(final: Path, reference: Path | None) -> Check:
    from checkpointing import diff_states

    if reference is None:
        return Check(name="bitwise", ok=False, detail="no fault-free reference")
    if not (final / "manifest.json").is_file():
        return Check(name="bitwise", ok=False, detail="no final state to compare")
    try:
        diff = diff_states(reference, final)
    except Exception as e:  # an unreadable final state is a broken invariant, not a crash of the checker
        return Check(name="bitwise", ok=False, detail=f"final state unreadable: {e}")
    return Check(name="bitwise", ok=diff is None, detail="bitwise equal to the fault-free run" if diff is None else diff)


def _recovery_checks(inv: Invariants, timelines: list[FaultTimeline], fired: list[FaultTimeline]) -> list[Check]:
    out = []
    if not inv.min_faults:
        missing = [t.label for t in timelines if t.injected is None]
        out.append(Check(name="all_fired", ok=not missing,
                         detail=f"never fired: {', '.join(missing[:5])}" if missing else f"{len(fired)} fault(s) fired"))
    def limit(t: FaultTimeline, own: float | None, default: float) -> float:
        return own if own is not None else default

    late = [t for t in fired if not t.tolerated and (
        t.detect_s is None or t.detect_s > limit(t, t.detect_timeout_s, inv.detect_timeout_s))]
    out.append(Check(name="detected", ok=not late, detail=_worst(late, "detect_s", "detect_timeout_s", inv.detect_timeout_s,
                                                                 "detected")
                     or f"every fault detected within its limit (default {inv.detect_timeout_s:g} s)"))
    slow = [t for t in fired if t.recover_s is None or t.recover_s > limit(t, t.recover_timeout_s, inv.recover_timeout_s)]
    out.append(Check(name="recovered", ok=not slow, detail=_worst(slow, "recover_s", "recover_timeout_s",
                                                                  inv.recover_timeout_s, "recovered")
                     or f"every fault recovered within its limit (default {inv.recover_timeout_s:g} s)"))
    redone = [t for t in fired if (t.steps_redone or 0) > inv.max_steps_redone]
    out.append(Check(name="steps_redone", ok=not redone,
                     detail=f"{redone[0].label}: {redone[0].steps_redone} steps redone (bound {inv.max_steps_redone})"
                     if redone else f"at most {max((t.steps_redone or 0) for t in fired) if fired else 0} "
                                    f"step(s) redone per fault (bound {inv.max_steps_redone})"))
    return out


def _worst(bad: list[FaultTimeline], attr: str, own: str, default: float, what: str) -> str:
    if not bad:
        return ""
    t = bad[0]
    v = getattr(t, attr)
    limit = getattr(t, own) if getattr(t, own) is not None else default
    return (f"{len(bad)} fault(s) not {what} in time; first: {t.label}: "
            + (f"{v:.2f} s (limit {limit:g} s)" if v is not None else f"never {what}"))
