"""Straggler scoring on 4 real worker processes that step in lock-step (a shared barrier
stands in for the all-reduce); one of them does its own work 1.5 times slower."""

from __future__ import annotations

import io

import pytest
from monhelp import CTX, Procs, wait_for, wait_step
from monitor_workers import train_loop

from monitors.cli import straggler_main
from monitors.control import read_control
from monitors.straggler import StragglerConfig, StragglerDetector, StragglerReport

WORLD = 4
INTERVAL = 0.4


def _start(procs: Procs, run: str, plan: dict) -> object:
    barrier = CTX.Barrier(WORLD)
    stop = CTX.Event()
    procs.keep += [barrier, stop]  # alive until the children have unpickled them
    for rank in range(WORLD):
        procs.start(train_loop, run, rank, plan, barrier, stop)
    return stop


def _next_report(det: StragglerDetector) -> StragglerReport:
    return wait_for(det.poll, 10 * INTERVAL + 10.0, "a straggler report", every=0.02)


@pytest.mark.timeout(120)
def test_slow_rank_flagged_within_three_intervals_and_healthy_ranks_never(tmp_path, procs: Procs) -> None:
    run = str(tmp_path)
    stop = _start(procs, run, {"slow_rank": 1, "slow_from": 20, "slow_factor": 1.5})
    wait_step(run, 0, 1, timeout=60.0)
    det = StragglerDetector(StragglerConfig(report_interval_s=INTERVAL, patience=2), run, range(WORLD))
    healthy_reports = 0
    first_slow: int | None = None
    flagged_at: int | None = None
    while flagged_at is None:
        rep = _next_report(det)
        assert rep.enabled
        assert all(d.rank == 1 for d in rep.flagged), f"healthy rank flagged: {rep.flagged}"
        last = [s.last_step for s in rep.scores.values()]
        if first_slow is None and last and max(last) >= 20:
            first_slow = rep.interval
        elif first_slow is None and len(rep.scores) == WORLD:
            healthy_reports += 1
        if rep.flagged:
            flagged_at = rep.interval
            decision = rep.flagged[0]
            assert decision.new and decision.action == "log"
            assert decision.relative < 0.75
            assert rep.scores[0].relative > 0.75
        assert rep.interval < 60
    assert first_slow is not None and healthy_reports >= 1
    assert flagged_at - first_slow + 1 <= 3
    stop.set()


@pytest.mark.timeout(120)
def test_no_rank_flagged_over_300_healthy_steps(tmp_path, procs: Procs) -> None:
    run = str(tmp_path)
    stop = _start(procs, run, {"steps": 310})
    wait_step(run, 0, 1, timeout=60.0)
    det = StragglerDetector(StragglerConfig(report_interval_s=INTERVAL, patience=2), run, range(WORLD))
    scored = 0
    while True:
        rep = _next_report(det)
        assert rep.flagged == [], f"healthy rank flagged: {rep.flagged} {rep.scores}"
        scored += len(rep.scores) == WORLD
        if rep.scores and min(s.last_step for s in rep.scores.values()) >= 300:
            break
        if not rep.scores and scored:
            break  # every rank finished
    assert scored >= 5
    stop.set()


@pytest.mark.timeout(120)
def test_switching_off_and_on_and_threshold_take_effect_at_the_next_report(tmp_path, procs: Procs) -> None:
    run = str(tmp_path)
    stop = _start(procs, run, {"slow_rank": 2, "slow_from": 0, "slow_factor": 1.5})
    wait_step(run, 0, 1, timeout=60.0)
    det = StragglerDetector(StragglerConfig(report_interval_s=INTERVAL, patience=1), run, range(WORLD))

    def flagged() -> list[int]:
        return [d.rank for d in _next_report(det).flagged]

    wait_for(lambda: flagged() == [2], 30.0, "rank 2 to be flagged", every=0.0)
    out = io.StringIO()
    assert straggler_main([run, "--off"], out=out) == 0
    assert "off" in out.getvalue() and read_control(run).enabled is False
    rep = _next_report(det)
    assert not rep.enabled and rep.flagged == [] and rep.scores == {}
    assert straggler_main([run, "--on"], out=io.StringIO()) == 0
    rep = _next_report(det)
    assert rep.enabled and [d.rank for d in rep.flagged] == [2]
    assert straggler_main([run, "--threshold", "0.5"], out=io.StringIO()) == 0
    rep = _next_report(det)
    assert rep.threshold == 0.5 and rep.flagged == [] and rep.scores[2].relative > 0.5
    stop.set()


@pytest.mark.timeout(30)
def test_config_and_cli_reject_bad_values(tmp_path) -> None:
    with pytest.raises(ValueError, match="threshold"):
        StragglerConfig(threshold=1.5)
    with pytest.raises(ValueError, match="policy"):
        StragglerConfig(policy="kill")
    assert straggler_main([str(tmp_path), "--threshold", "0"], out=io.StringIO()) == 2
    assert straggler_main([str(tmp_path / "missing"), "--on"], out=io.StringIO()) == 2
    assert straggler_main([str(tmp_path), "--on", "--off"], out=io.StringIO()) == 2


@pytest.mark.timeout(60)
def test_a_rank_scored_alone_is_neither_cleared_nor_announced_again(tmp_path) -> None:
    """With nobody to compare with, a relative score says nothing: the count of slow
    intervals is kept, and a rank already flagged is not announced a second time."""
    import time

    from monitors.progress import ProgressReporter

    reps = {r: ProgressReporter(tmp_path, r) for r in (0, 1)}
    next_step = {0: 0, 1: 0}

    def run(rank: int, n: int, work_s: float) -> None:
        for _ in range(n):
            s = next_step[rank]
            reps[rank].enter("data", s)
            reps[rank].enter("forward", s)
            time.sleep(work_s)  # the work itself
            reps[rank].enter("all-reduce", s)
            next_step[rank] = s + 1
        reps[rank].enter("data", next_step[rank])  # closes the last step

    det = StragglerDetector(StragglerConfig(patience=2, min_steps=3), tmp_path, [0, 1])
    for _ in range(2):
        run(0, 3, 0.01)
        run(1, 3, 0.04)
        report = det.report()
    assert [(d.rank, d.new) for d in report.flagged] == [(1, True)]
    run(1, 3, 0.04)  # rank 0 made no step this interval
    report = det.report()
    assert set(report.scores) == {1} and report.scores[1].intervals_below == 2
    assert [(d.rank, d.new) for d in report.flagged] == [(1, False)]
    run(0, 3, 0.01)
    run(1, 3, 0.04)
    report = det.report()
    assert report.scores[1].intervals_below == 3 and [(d.rank, d.new) for d in report.flagged] == [(1, False)]
    for rep in reps.values():
        rep.close()
    det.close()
