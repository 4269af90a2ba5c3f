"""Issue 17, item 4: a fault is detected by the event that acted on it, not by the first report of any rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.driver import JobRun
from chaos.scenario import Invariants
from chaos.schedule import PlannedFault
from chaos.testing import chaos_reference_cache, chaos_run  # noqa: F401  (fixtures)
from chaos.timeline import build_timelines
from chaos.verdict import check_invariants

HERE = Path(__file__).resolve().parent


def _events(t0: float) -> list[dict]:
    """What the run in the issue logged: rank 1 stopped, rank 0 reported waiting on it after 2 s, the agent
    killed rank 1 (its own timeout) 12 s after the fault."""
    steps = [{"time": t0 - 1 + 0.1 * s, "event": "step_done", "step": s, "generation": 0, "source": "rank0"}
             for s in range(1, 8)]
    return steps + [
        {"time": t0, "event": "fault_injected", "rank": 1, "kind": "hang", "phase": "forward", "step": 8,
         "source": "rank1"},
        {"time": t0 + 2.0, "event": "hang_detected", "rank": 0, "section": "all-reduce", "waiting": True,
         "waiting_on": [1], "source": "monitor"},
        {"time": t0 + 12.0, "event": "hang_detected", "rank": 1, "section": "data", "waiting": False,
         "source": "monitor"},
        {"time": t0 + 12.3, "event": "fault_detected", "rank": 1, "kind": "hang", "how": "signal SIGKILL",
         "source": "agent"},
        {"time": t0 + 12.4, "event": "fault_detected", "rank": 0, "kind": "GenerationFailed", "source": "rank0"},
        {"time": t0 + 15.0, "event": "step_done", "step": 8, "generation": 1, "source": "rank0"},
    ]


@pytest.mark.timeout(30)
def test_a_waiting_peer_does_not_count_as_detection(tmp_path: Path) -> None:
    t0 = 1000.0
    plan = [PlannedFault(kind="hang", ranks=(1,), phase="forward", step=8, detect_timeout_s=6)]
    [tl] = build_timelines(_events(t0), plan, [], launch=t0 - 5)
    assert tl.detect_s == pytest.approx(12.3) and tl.detected_by == "agent (fault_detected)"
    run = JobRun(run_dir=tmp_path, returncode=0, timed_out=False, launch_time=t0 - 5, end_time=t0 + 20)
    inv = Invariants(completes=False, bitwise=False, valid_latest=False)
    checks = {c.name: c for c in check_invariants(inv, run, None, [tl], timeout_s=60)}
    assert not checks["detected"].ok and "12.30 s (limit 6 s)" in checks["detected"].detail
    assert checks["recovered"].ok
    # A kill is still detected by whichever party acts first (here a survivor's collective error).
    kill = [PlannedFault(kind="kill", ranks=(1,), phase="forward", step=8)]
    ev = _events(t0)
    ev[7]["kind"] = "kill"
    ev.insert(8, {"time": t0 + 0.2, "event": "fault_detected", "rank": 0, "kind": "RuntimeError", "source": "rank0"})
    [tk] = build_timelines(ev, kill, [], launch=t0 - 5)
    assert tk.detect_s == pytest.approx(0.2)


@pytest.mark.timeout(300)
def test_a_hung_rank_detected_late_fails_the_scenario(chaos_run) -> None:  # noqa: F811
    result = chaos_run(HERE / "scenarios" / "late-hang-detection.yaml", expect_broken={"detected"})
    [tl] = result.timelines
    assert tl.detected_by == "agent (fault_detected)" and tl.detect_s > 6
    from monitors import read_events

    waiting = [e for e in read_events(result.run.run_dir / "events.jsonl")
               if e["event"] == "hang_detected" and e.get("rank") == 0 and e.get("waiting")]
    # The trap was there: rank 0 was reported (waiting on rank 1) well before rank 1 was killed.
    assert waiting and waiting[0]["time"] - result.run.launch_time < tl.detected
