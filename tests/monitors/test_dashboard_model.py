"""The dashboard's data model on synthetic event logs: aggregation at 1,024 ranks, the recovery
timeline's phase split, incremental reading, and tolerance of unknown events and missing fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from monitors.dashboard.model import RunModel
from monitors.dashboard.scores import K_MAX

T0 = 1_800_000_000.0


def _write(run: Path, events: list[dict[str, Any]], mode: str = "w") -> None:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "events.jsonl", mode) as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def _ev(t: float, event: str, source: str = "agent", **fields: Any) -> dict[str, Any]:
    return {"time": T0 + t, "event": event, "source": source, **fields}


def _report(t: float, interval: int, scores: dict[int, tuple[float, float]], **extra: Any) -> dict[str, Any]:
    return _ev(t, "straggler_report", "monitor", interval=interval, enabled=True, threshold=0.75,
               control_read_at=T0 + t, scores={str(r): {
                   "relative": rel, "individual": ind, "step_s": 0.01, "work_s": 0.008, "steps": 20,
                   "last_step": interval * 20, "clock": "wall",
                   "sections_s": {"forward": 0.004 / rel, "backward": 0.004, "all-reduce": 0.002}}
                   for r, (rel, ind) in scores.items()}, **extra)


@pytest.mark.timeout(60)
def test_1024_ranks_show_the_worst_k_and_aggregates_not_every_rank(tmp_path: Path) -> None:
    world = 1024
    slow = {511: 0.3, 17: 0.45, 1000: 0.6}  # rank -> relative score while slow
    events = [_ev(0, "agent_start", world_size=world)]
    for i in range(1, 121):
        scores = {r: (slow.get(r, 0.95 + 0.05 * ((r * 7 + i) % 3) / 2) if i > 20 else 1.0, 1.0) for r in range(world)}
        events.append(_report(i, i, scores))
    events += [_ev(25, "straggler_detected", "monitor", rank=r, interval=22, action="log", relative=s, individual=1.0)
               for r, s in slow.items()]
    events += [_ev(26, "straggler_detected", "monitor", rank=r, interval=23, action="log", relative=0.7, individual=1.0)
               for r in range(100, 300)]  # many flagged: the table still has a bounded number of rows
    _write(tmp_path, events)
    model = RunModel(tmp_path)
    assert model.refresh()
    snap = model.snapshot(metric="relative")
    st = snap["straggler"]
    assert st["ranks"] == world and st["reports"] == 120
    hm = st["heatmaps"]["relative"]
    assert len(hm["ranks"]) == K_MAX and len(hm["values"]) == K_MAX
    assert hm["ranks"][:3] == [511, 17, 1000], hm["ranks"][:5]  # worst first
    assert hm["worst"][:3] == [pytest.approx(0.3), pytest.approx(0.45), pytest.approx(0.6)]
    assert all(len(row) == len(hm["t"]) == 120 for row in hm["values"])
    dist = st["distribution"]["relative"]
    assert dist["min"][-1] == pytest.approx(0.3) and dist["median"][-1] > 0.9 and len(dist["t"]) == 120
    assert st["flagged_total"] == 203 and len(st["flagged"]) <= 64
    assert [f["rank"] for f in st["flagged"][:3]] == [511, 17, 1000]  # the slowest now first
    assert all(f["slow_now"] for f in st["flagged"][:3])
    # Sections are scored per section: rank 511's forward is the slow part, its backward is not.
    assert "section:forward" in st["metrics"] and "section:backward" in st["metrics"]
    fwd = model.snapshot(metric="section:forward")["straggler"]["heatmaps"]["section:forward"]
    assert fwd["ranks"][0] == 511 and fwd["worst"][0] == pytest.approx(0.3, rel=1e-3)
    bwd = model.snapshot(metric="section:backward")["straggler"]["heatmaps"]["section:backward"]
    assert bwd["worst"][0] == pytest.approx(1.0)
    # What the page receives stays small however many ranks there are.
    assert len(json.dumps(snap)) < 400_000


@pytest.mark.timeout(60)
def test_long_runs_merge_heatmap_columns_keeping_the_worst_score(tmp_path: Path) -> None:
    events = [_ev(0, "agent_start", world_size=2)]
    for i in range(1, 601):
        events.append(_report(i, i, {0: (1.0, 1.0), 1: (0.2 if i == 300 else 1.0, 1.0)}))
    _write(tmp_path, events)
    model = RunModel(tmp_path)
    model.refresh()
    hm = model.snapshot()["straggler"]["heatmaps"]["relative"]
    assert hm["merged"] == 3 and len(hm["t"]) == 200
    assert hm["ranks"] == [1, 0] and min(v for v in hm["values"][0] if v is not None) == pytest.approx(0.2)


def _kill_sequence(t: float, g: int, *, dead: int, first_step_s: float | None = None) -> list[dict[str, Any]]:
    """What a SIGKILLed rank looks like in a real 4-rank log: the survivors report the broken
    collective in generation g, the agent (one poll later) in g+1, and recover into g+2."""
    survivors = [r for r in range(4) if r != dead]
    ev = [_ev(t, "fault_injected", f"rank{dead}", rank=dead, pid=100 + dead, kind="kill", phase="backward", step=20)]
    ev += [_ev(t + 0.04 + 0.01 * i, "fault_detected", f"rank{r}", rank=r, generation=g, step=20, phase="all-reduce",
               kind="RuntimeError", error="Connection closed by peer") for i, r in enumerate(survivors)]
    ev.append(_ev(t + 0.05, "fault_detected", "agent", rank=dead, how="signal SIGKILL", pid=100 + dead,
                  generation=g + 1, kind="exit"))
    ev.append(_ev(t + 0.05, "worker_spawned", rank=dead, pid=200 + dead, generation=g + 2, replacement=True, warm=True,
                  spare_ready=False))
    ev.append(_ev(t + 1.0, "run_start", f"rank{dead}", rank=dead, pid=200 + dead, replacement=True, since_spawn_s=0.95))
    for i, r in enumerate(survivors):
        extra = {"first_step_s": first_step_s} if first_step_s is not None else {}
        ev.append(_ev(t + 1.2 + 0.01 * i, "recovery_done", f"rank{r}", rank=r, generation=g + 2, resume_step=20,
                      replacements=[dead], detect_s=0.01, abort_s=0.001, rendezvous_s=1.0, heal_s=0.05,
                      steps_redone=0, **extra))
    return ev


@pytest.mark.timeout(60)
def test_a_kill_is_one_bar_split_into_detect_abort_rendezvous_heal_and_first_step(tmp_path: Path) -> None:
    ev = [_ev(0, "agent_start", world_size=4)]
    ev += [_ev(1 + 0.1 * s, "step_done", "rank0", step=s, loss=4.0, generation=0) for s in range(1, 20)]
    ev += _kill_sequence(5.0, 0, dead=1)
    ev += [_ev(6.5 + 0.1 * s, "step_done", "rank0", step=20 + s, loss=3.0, generation=2) for s in range(1, 5)]
    ev.append(_ev(7.0, "a_future_event_nobody_knows", "rank0", whatever=[1, 2]))
    _write(tmp_path, ev)
    model = RunModel(tmp_path)
    model.refresh()
    snap = model.snapshot()
    [inc] = snap["incidents"]
    assert (inc["kind"], inc["ranks"], inc["phase"], inc["step"], inc["state"]) == ("kill", [1], "backward", 20, "recovered")
    assert inc["cause"] == "agent: the rank exited (signal SIGKILL)" and inc["reported"] == 4
    seg = dict(inc["segments"])
    crit = max(r for r in range(4) if r != 1)  # the survivor whose recovery_done came last
    assert inc["critical_rank"] == crit
    own_detect = 0.04 + 0.01 * 2  # rank 3's own fault_detected, 60 ms after the injection
    assert seg["detect"] == pytest.approx(own_detect, abs=1e-3)
    assert (seg["abort"], seg["rendezvous"], seg["heal"]) == (pytest.approx(0.001), pytest.approx(1.0), pytest.approx(0.05))
    assert seg["other"] == pytest.approx(1.2 + 0.02 - own_detect - 1.051, abs=1e-3)
    assert seg["first_step"] == pytest.approx(6.6 - 6.22, abs=1e-3)  # recovery_done to the next step_done
    assert inc["total_s"] == pytest.approx(6.6 - 5.0, abs=1e-3)
    assert inc["spawned"] == [{"rank": 1, "warm": True, "spare_ready": False, "started_s": 0.95}]
    assert snap["events"]["unknown"] == {"a_future_event_nobody_knows": 1}
    assert snap["run"]["faults"] == 1 and snap["run"]["state"] == "running"


@pytest.mark.timeout(60)
def test_first_step_s_is_used_when_the_event_has_it_and_missing_fields_are_tolerated(tmp_path: Path) -> None:
    ev = [_ev(0, "agent_start")]  # no world size
    ev += _kill_sequence(5.0, 3, dead=2, first_step_s=0.25)
    for e in ev:
        if e["event"] == "recovery_done":
            del e["abort_s"], e["steps_redone"]  # an older or newer runtime may not write them
    ev.append({"event": "fault_detected", "source": "rank0"})  # no time: ignored, counted
    ev.append(_ev(9, "agent_end", ok=True))
    _write(tmp_path, ev)
    model = RunModel(tmp_path)
    model.refresh()
    snap = model.snapshot()
    [inc] = snap["incidents"]
    seg = dict(inc["segments"])
    assert seg["first_step"] == 0.25 and seg["abort"] == 0.0 and inc["steps_redone"] is None
    assert snap["run"]["state"] == "finished" and snap["run"]["world_size"] is None
    assert snap["events"]["unknown"] == {"(no time)": 1}


@pytest.mark.timeout(60)
def test_a_hang_carries_the_hung_ranks_stacks_and_a_recovery_in_progress_grows(tmp_path: Path) -> None:
    dump = ('# pid 103\nThread 0x1 (most recent call first):\n  File "/x/threading.py", line 320 in wait\n'
            'Current thread 0x2 (most recent call first):\n  File "/job/train.py", line 77 in forward\n')
    ev = [_ev(0, "agent_start", world_size=4),
          _ev(10.0, "fault_injected", "rank3", rank=3, kind="block", phase="forward", step=60),
          _ev(13.1, "hang_detected", "monitor", rank=3, pid=103, section="forward", step=60, since_progress_s=3.1,
              timeout_s=3.0, waiting_on=[], waiting=False),
          _ev(13.1, "hang_detected", "monitor", rank=0, pid=100, section="all-reduce", step=60, since_progress_s=3.1,
              timeout_s=3.0, waiting_on=[3], waiting=True),
          _ev(13.2, "hang_stacks", rank=3, pid=103, stacks=dump),
          _ev(13.25, "fault_detected", "agent", rank=3, how="signal SIGKILL", pid=103, generation=5, kind="hang",
              phase="forward", step=60)]
    _write(tmp_path, ev)
    model = RunModel(tmp_path)
    model.refresh()
    [inc] = model.snapshot(now=T0 + 20.0)["incidents"]
    assert inc["state"] == "recovering" and inc["cause"] == "agent: killed as hung (signal SIGKILL)"
    assert inc["hang"] == {"section": "forward", "step": 60, "since_progress_s": 3.1, "timeout_s": 3.0}
    assert inc["stacks"] == dump and inc["stuck_in"] == "/job/train.py:77 in forward"
    assert dict(inc["segments"]) == {"detect": pytest.approx(3.25), "recovering": pytest.approx(6.75)}


@pytest.mark.timeout(60)
def test_planted_faults_that_needed_no_recovery_are_listed_too(tmp_path: Path) -> None:
    ev = [_ev(0, "agent_start", world_size=4),
          _ev(2.0, "fault_injected", "rank2", rank=2, kind="slow", phase="forward", step=10),
          _ev(4.5, "straggler_detected", "monitor", rank=2, interval=4, action="log", relative=0.2, individual=0.3)]
    _write(tmp_path, ev)
    model = RunModel(tmp_path)
    model.refresh()
    [inc] = model.snapshot()["incidents"]
    assert (inc["kind"], inc["ranks"], inc["segments"]) == ("slow", [2], [])
    assert inc["state"] == "flagged as a straggler after 2.5 s"


@pytest.mark.timeout(60)
def test_the_log_is_read_incrementally_a_torn_line_waits_and_a_new_file_resets(tmp_path: Path) -> None:
    _write(tmp_path, [_ev(0, "agent_start", world_size=2), _ev(1, "step_done", "rank0", step=1, generation=0)])
    model = RunModel(tmp_path)
    assert model.refresh() and model.snapshot()["steps"]["count"] == 1
    assert not model.refresh()  # nothing new
    line = json.dumps(_ev(2, "step_done", "rank0", step=2, generation=0)) + "\n"
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(line[:20])  # a writer between two writes
    model.refresh()
    assert model.snapshot()["steps"]["count"] == 1
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(line[20:])
    assert model.refresh() and model.snapshot()["steps"]["count"] == 2
    (tmp_path / "events.jsonl").unlink()  # a new job in the same directory, after a clean-up
    _write(tmp_path, [_ev(5, "agent_start", world_size=8)])
    assert model.refresh()
    snap = model.snapshot()
    assert snap["steps"]["count"] == 0 and snap["run"]["world_size"] == 8


@pytest.mark.timeout(60)
def test_checkpoints_stall_durable_failures_and_verify_failures(tmp_path: Path) -> None:
    ev = [_ev(0, "agent_start", world_size=2)]
    for step, stall, durable in ((10, 0.02, 1.5), (20, 0.01, 0.5)):
        for r in range(2):
            ev.append(_ev(step, "checkpoint_staged", f"rank{r}", step=step, rank=r, seconds=stall * (r + 1), bytes=1000))
            ev.append(_ev(step + 1, "checkpoint_committed", f"rank{r}", step=step, rank=r, seconds=durable, bytes=1000))
    ev += [_ev(31, "checkpoint_staged", "rank0", step=30, rank=0, seconds=0.01, bytes=1000),
           _ev(40, "checkpoint_failed", "rank0", step=30, rank=0, reason="disk full"),
           _ev(41, "checkpoint_skipped", "rank1", step=40, in_flight=30, rank=1),
           _ev(50, "checkpoint_invalid", "rank0", step=20, file="__0_0.distcp", reason="checksum mismatch", rank=0),
           _ev(51, "checkpoint_loaded", "rank0", step=10, saved_world_size=2, world_size=2, rank=0)]
    _write(tmp_path, ev)
    model = RunModel(tmp_path)
    model.refresh()
    c = model.snapshot()["checkpoints"]
    assert [(s["step"], s["committed"], s["stall_s"], s["durable_s"]) for s in c["saves"]] == [
        (10, True, 0.04, 1.5), (20, True, 0.02, 0.5), (30, False, 0.01, None)]
    assert (c["total"], c["committed"], c["failed_total"], c["skipped"]) == (3, 2, 1, 1)
    assert c["stall_max_s"] == 0.04 and c["durable_max_s"] == 1.5 and c["durable_mean_s"] == 1.0
    assert c["invalid"] == [{"step": 20, "rank": 0, "file": "__0_0.distcp", "reason": "checksum mismatch", "t": 50.0}]
    assert c["failed"][0]["reason"] == "disk full" and c["loaded"][0]["step"] == 10


@pytest.mark.timeout(60)
def test_a_nan_loss_does_not_break_the_pages_json(tmp_path: Path) -> None:
    _write(tmp_path, [_ev(0, "agent_start", world_size=1)])
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"time": %r, "event": "step_done", "source": "rank0", "step": 1, "loss": NaN}\n' % (T0 + 1))
    model = RunModel(tmp_path)
    model.refresh()
    json.loads(json.dumps(model.snapshot(), allow_nan=False))


@pytest.mark.timeout(60)
def test_a_backlog_larger_than_one_read_is_taken_in_slices_by_one_refresh(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import monitors.dashboard.tail as tail

    monkeypatch.setattr(tail, "_MAX_READ", 300)  # a few lines per slice
    _write(tmp_path, [_ev(0, "agent_start", world_size=1)]
           + [_ev(s, "step_done", "rank0", step=s, generation=0) for s in range(1, 101)])
    model = RunModel(tmp_path)
    assert model.refresh()
    assert model.snapshot()["steps"]["count"] == 100


@pytest.mark.timeout(60)
def test_every_rank_lost_is_timed_to_the_checkpoint_load_and_the_first_step(tmp_path: Path) -> None:
    ev = [_ev(0, "agent_start", world_size=2),
          _ev(5.0, "fault_injected", "rank0", rank=0, kind="kill", phase="forward", step=30),
          _ev(5.0, "fault_injected", "rank1", rank=1, kind="kill", phase="forward", step=30),
          _ev(5.1, "fault_detected", "agent", rank=0, how="signal SIGKILL", generation=3, kind="exit"),
          _ev(5.1, "fault_detected", "agent", rank=1, how="signal SIGKILL", generation=3, kind="exit"),
          _ev(9.0, "resumed_from_disk", "rank0", rank=0, step=24, generation=4),
          _ev(9.0, "resumed_from_disk", "rank1", rank=1, step=24, generation=4),
          _ev(9.5, "step_done", "rank0", step=25, generation=4)]
    _write(tmp_path, ev)
    model = RunModel(tmp_path)
    model.refresh()
    [inc] = model.snapshot()["incidents"]  # both ranks, killed at once, in one generation: one incident
    assert inc["ranks"] == [0, 1] and inc["state"] == "recovered from disk" and inc["from_disk_step"] == 24
    assert dict(inc["segments"]) == {"detect": pytest.approx(0.1), "other": pytest.approx(3.9),
                                     "first_step": pytest.approx(0.5)}
