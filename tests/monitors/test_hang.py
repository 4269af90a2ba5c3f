"""Hang detection against real processes: SIGSTOP, a GIL-holding spin, blocked data loading while a
heartbeat thread runs, a gloo collective blocked by a stopped peer; and what is not a hang: an evaluation
inside a step (in the rank, or in a child process it waits for), the agent's own pause."""

from __future__ import annotations

import json
import os
import signal
import time
from multiprocessing.process import BaseProcess
from typing import Sequence

import pytest
from monhelp import CTX, Procs, wait_for, wait_step
from monitor_workers import gloo_rank, train_loop

from monitors.hang import IMPOSSIBLE_READS_BEFORE_JUDGING, HangDetector
from monitors.hangverdict import Evidence, Hang
from monitors.hangconfig import HangConfig
from monitors.progress import ProgressReporter
from monitors.progressreader import ProgressReader
from monitors.stacks import is_stopped

TIMEOUT = 1.0


def _detect(det: HangDetector, rank: int, budget: float, alive: Sequence[BaseProcess] = ()) -> Hang:
    """Polls like the agent (every 50 ms) until ``rank`` is reported hung."""
    def found() -> Hang | None:
        return next((h for h in det.poll() if h.rank == rank), None)

    return wait_for(found, budget, f"a hang of rank {rank}", every=0.05, alive=alive)


def _frozen_since(run_dir: str, rank: int) -> float:
    snap = ProgressReader(run_dir, rank).read()
    assert snap is not None
    return snap.last_progress_s


@pytest.mark.timeout(60)
def test_a_stopped_rank_is_hung_once_it_stayed_stopped_for_the_stopped_timeout(tmp_path, procs: Procs) -> None:
    run = str(tmp_path)
    p = procs.start(train_loop, run, 0, {})
    det = HangDetector(HangConfig(stopped_timeout_s=TIMEOUT), run, [0])
    wait_step(run, 0, 3)
    assert det.poll() == []
    os.kill(p.pid, signal.SIGSTOP)
    hang = _detect(det, 0, budget=TIMEOUT + 5.0)
    assert hang.pid == p.pid and hang.evidence == Evidence.STOPPED.value and hang.stopped
    assert hang.timeout_s == TIMEOUT and hang.for_s > TIMEOUT and not hang.blocked_by_peer
    assert "stopped (SIGSTOP or a debugger)" in hang.describe()
    os.kill(p.pid, signal.SIGCONT)  # continued: it makes progress again and is no longer hung
    wait_for(lambda: det.poll() == [], 10.0, "the continued rank to be no longer hung")


@pytest.mark.timeout(60)
def test_gil_holding_spin_is_busy_and_hung_only_past_the_busy_timeout(tmp_path, procs: Procs) -> None:
    run = str(tmp_path)
    busy = 3.0
    procs.start(train_loop, run, 0, {"hang_at": 5, "hang": "spin"})
    det = HangDetector(HangConfig(computed=False, idle_timeout_s=TIMEOUT, busy_timeout_s=busy), run, [0])
    hang = _detect(det, 0, budget=30.0 + busy)  # start-up included; the rank hangs at step 5
    # It computes: never taken for idle, though it was past the idle timeout for two seconds.
    assert (hang.section, hang.step, hang.evidence, hang.timeout_s) == ("forward", 5, Evidence.BUSY.value, busy)
    assert hang.since_progress_s > busy


@pytest.mark.timeout(60)
def test_blocked_data_loading_is_idle_while_a_heartbeat_thread_runs(tmp_path, procs: Procs) -> None:
    run = str(tmp_path)
    ticks = CTX.Value("q", 0)
    procs.start(train_loop, run, 0, {"hang_at": 4, "hang": "block-data", "hang_section": "data", "ticks": ticks})
    det = HangDetector(HangConfig(computed=False, idle_timeout_s=TIMEOUT), run, [0])
    hang = _detect(det, 0, budget=30.0)
    assert (hang.section, hang.step, hang.evidence) == ("data", 4, Evidence.IDLE.value)
    assert hang.for_s > TIMEOUT and hang.timeout_s == TIMEOUT
    # The heartbeat thread kept beating all along and still does: liveness is not progress.
    seen = ticks.value
    assert seen > 0
    wait_for(lambda: ticks.value > seen + 5, 10.0, "more heartbeats")
    assert [h.rank for h in det.poll()] == [0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("in_child", [False, True], ids=["in-the-rank", "in-a-child-process"])
def test_an_evaluation_inside_a_step_is_not_a_hang(tmp_path, procs: Procs, in_child: bool) -> None:
    """Four seconds of work in the step's forward section, four times the idle timeout: the rank (or a child
    process it waits for, as a DataLoader's workers) uses CPU all along, so it is never taken for hung."""
    run = str(tmp_path)
    eval_s = 4 * TIMEOUT
    p = procs.start(train_loop, run, 0, {"eval_at": 3, "eval_s": eval_s, "eval_in_child": in_child})
    det = HangDetector(HangConfig(computed=False, idle_timeout_s=TIMEOUT), run, [0])
    reader = ProgressReader(run, 0)
    longest = 0.0  # the longest time without progress the detector was asked about
    while (snap := reader.read()) is None or snap.step < 5:  # through the evaluation and two steps beyond it
        now = time.monotonic()
        assert det.poll(now) == [], f"a healthy rank taken for hung at {snap and (snap.section, snap.step)}"
        if snap is not None:
            longest = max(longest, now - snap.last_progress_s)
        assert p.is_alive()
        time.sleep(0.05)
    assert longest > 2 * TIMEOUT  # it was judged well past the idle timeout, and found working


@pytest.mark.timeout(60)
def test_the_agents_own_pause_is_not_charged_to_the_ranks(tmp_path) -> None:
    """The agent's clock jumped (the whole job was stopped and continued): a rank idle since before the pause
    is timed from the pause's end, not from its last progress."""
    run = str(tmp_path)
    w = ProgressReporter(run, 0)
    w.enter("data", 7)
    det = HangDetector(HangConfig(computed=False, idle_timeout_s=2.0, busy_timeout_s=2.0), run, [0])
    last = _frozen_since(run, 0)
    det.paused(last + 10.0)  # the agent ran again 10 s after the rank's last progress
    assert det.poll(last + 10.5) == []
    assert det.poll(last + 11.9) == []
    assert [(h.rank, round(h.since_progress_s, 1)) for h in det.poll(last + 12.5)] == [(0, 2.5)]
    w.close()


@pytest.mark.timeout(180)
def test_collective_blocked_by_a_stopped_peer(tmp_path, procs: Procs) -> None:
    import datetime

    import torch.distributed as dist

    run = str(tmp_path)
    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    result_r, result_w = CTX.Pipe(duplex=False)
    ranks = [procs.start(gloo_rank, run, rank, 2, store.port, 5, result_w) for rank in (0, 1)]
    cfg = HangConfig(stopped_timeout_s=TIMEOUT, busy_timeout_s=2 * TIMEOUT)
    det = HangDetector(cfg, run, [0, 1])
    hang1 = _detect(det, 1, budget=120.0, alive=ranks)  # includes two torch imports on a loaded machine
    assert (hang1.section, hang1.step, hang1.blocked_by_peer, hang1.evidence) == ("forward", 5, False, "stopped")
    hang0 = _detect(det, 0, budget=10.0, alive=ranks)  # it waits in the all-reduce: reported past the busy limit
    assert (hang0.section, hang0.waiting_on, hang0.evidence) == ("all-reduce", (1,), Evidence.WAITING.value)
    # The agent kills the culprit; the survivor's collective fails instead of hanging.
    os.kill(ranks[1].pid, signal.SIGKILL)
    assert result_r.poll(60.0), "rank 0 stayed blocked after its peer was killed"
    assert result_r.recv() != ""
    reader = ProgressReader(run, 0)
    wait_for(lambda: reader.read().section == "recovery", 30.0, "rank 0 to enter recovery")


@pytest.mark.timeout(60)
def test_computed_timeouts_merge_ranks_and_round_trip_as_json(tmp_path, procs: Procs) -> None:
    run = str(tmp_path)
    for rank in (0, 1):
        procs.start(train_loop, run, rank, {"steps": 12, "slow_rank": 1, "slow_factor": 3.0})
    cfg = HangConfig(safety_factor=4.0, min_observations=10, idle_timeout_s=0.01)
    det = HangDetector(cfg, run, [0, 1])
    assert det.timeout("backward") == 0.01 and det.computed("backward") is None
    readers = [ProgressReader(run, r) for r in (0, 1)]
    wait_for(lambda: all((s := rd.read()) is not None and s.closed for rd in readers), 30.0, "both ranks to finish")
    det.poll()
    maxima = [rd.read().section_max_s["backward"] for rd in readers]
    assert det.timeout("backward") == pytest.approx(4.0 * max(maxima))
    assert max(maxima) == maxima[1]  # rank 1 is the slow one: its maximum wins
    assert det.timeout("checkpoint") == cfg.long_section_timeout_s
    state = json.loads(json.dumps(det.state_dict()))
    fresh = HangDetector(cfg, run, [])
    fresh.load_state_dict(state)
    assert fresh.timeout("backward") == det.timeout("backward")
    assert det.poll() == []  # finished (closed) ranks are never hung


@pytest.mark.timeout(60)
def test_startup_window_and_reset_after_respawn(tmp_path, procs: Procs) -> None:
    run = str(tmp_path)
    cfg = HangConfig(computed=False, idle_timeout_s=TIMEOUT, startup_timeout_s=5.0)
    t0 = time.monotonic()
    det = HangDetector(cfg, run, [0])
    assert det.poll(t0 + 6.0) == []  # never reported progress (a plain script): not watched
    det.reset(0, now=t0, expect_progress=True)  # a rank whose predecessor reported
    assert det.poll(t0 + 4.0) == []  # no slot yet: start-up
    assert [(h.rank, h.section, h.pid) for h in det.poll(t0 + 6.0)] == [(0, "startup", None)]
    p = procs.start(train_loop, run, 0, {})
    wait_step(run, 0, 2)
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=10)
    last = _frozen_since(run, 0)
    # The dead rank's slot is stale, and its process gone: idle.
    assert [(h.rank, h.evidence) for h in det.poll(last + TIMEOUT + 0.5)] == [(0, "idle")]
    det.reset(0, now=last + 1.0, expect_progress=True)
    assert det.poll(last + TIMEOUT + 0.5) == []  # its old slot is ignored; start-up window again
    assert [h.section for h in det.poll(last + 7.0)] == ["startup"]
    p2 = procs.start(train_loop, run, 0, {})
    wait_step(run, 0, 1, pid=p2.pid)
    assert det.poll() == []
    assert det.last[0] is not None and det.last[0].pid == p2.pid


def _hang(rank: int, section: str, step: int, waiting_on: tuple[int, ...] = (), evidence: str = "waiting") -> "Hang":
    from monitors.hangverdict import Hang

    return Hang(rank=rank, pid=1000 + rank, section=section, step=step, since_progress_s=5.0, timeout_s=3.0,
                waiting_on=waiting_on, evidence=evidence)


@pytest.mark.timeout(10)
def test_the_rank_behind_in_a_collective_is_killed_not_its_waiting_peers():
    from monitors.hangverdict import ranks_to_kill

    collective = ("all-reduce",)
    # Rank 2 stopped right after step 7's all-reduce; ranks 0, 1, 3 wait in step 8's.
    hangs = [_hang(0, "all-reduce", 8), _hang(1, "all-reduce", 8), _hang(2, "all-reduce", 7, evidence="idle"),
             _hang(3, "all-reduce", 8)]
    assert ranks_to_kill(hangs, collective) == [2]
    # Everyone stuck in the same collective (a broken network): nothing to single out.
    assert ranks_to_kill([_hang(0, "all-reduce", 8), _hang(1, "all-reduce", 8)], collective) == [0, 1]
    # A rank waiting on a local peer outside the collective is spared; the peer is killed.
    hangs = [_hang(0, "all-reduce", 8, waiting_on=(1,)), _hang(1, "forward", 8, evidence="idle")]
    assert ranks_to_kill(hangs, collective) == [1]


@pytest.mark.timeout(30)
def test_a_section_cut_short_by_a_fault_does_not_grow_the_computed_timeout(tmp_path) -> None:
    """Peers waiting on a hung rank leave their all-reduce for recovery: that wait is
    not an observation of how long an all-reduce takes."""

    rep = ProgressReporter(tmp_path, 0)
    for step in range(12):
        for section in ("data", "forward", "backward", "all-reduce", "optimizer"):
            rep.enter(section, step)
    rep.enter("all-reduce", 12)
    time.sleep(0.3)  # a peer hangs; the agent kills it; this rank's collective fails
    rep.enter("recovery", 12)
    rep.enter("data", 12)
    reader = ProgressReader(str(tmp_path), 0)
    snap = reader.read()
    completed = [r.sections_s["all-reduce"] for r in reader.steps(snap, 0)]
    assert len(completed) == 12
    assert snap.section_count["all-reduce"] == 12  # the interrupted one is not counted
    assert snap.section_max_s["all-reduce"] == max(completed)
    det = HangDetector(HangConfig(min_observations=10, idle_timeout_s=1e-9), str(tmp_path), [0])
    det.poll()
    assert det.timeout("all-reduce") == pytest.approx(5.0 * max(completed))
    rep.close()


@pytest.mark.timeout(30)
def test_a_slot_read_with_an_impossible_progress_time_is_not_judged(tmp_path) -> None:
    """A torn or damaged read must never make a healthy rank look idle since before it started."""
    import mmap
    import struct

    from monitors.progress import progress_path

    rep = ProgressReporter(tmp_path, 0)
    rep.enter("data", 7)
    # The writer is this test's own process, which computes: its limit is the busy one.
    det = HangDetector(HangConfig(computed=False, idle_timeout_s=0.5, busy_timeout_s=0.5), str(tmp_path), [0])
    with open(progress_path(tmp_path, 0), "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
        t_off = struct.calcsize("<4sIiIQQqii")  # the header's last-progress time (see monitors.progress._HEADER)
        good = mm[t_off:t_off + 8]
        assert struct.unpack("<q", good)[0] == round(ProgressReader(str(tmp_path), 0).read().last_progress_s * 1e9)
        mm[t_off:t_off + 8] = struct.pack("<q", 0)
        time.sleep(0.6)  # past the timeout, had the time been real
        assert det.poll() == [] and det.inconsistent_reads == 1
        mm[t_off:t_off + 8] = good
        hangs = det.poll()  # the real time: 0.6 s without progress
        assert [(h.rank, h.section, h.step) for h in hangs] == [(0, "data", 7)]
        # A slot that stays damaged is judged after a while, by the time since the rank was first watched.
        mm[t_off:t_off + 8] = struct.pack("<q", 0)
        polls = [det.poll() for _ in range(IMPOSSIBLE_READS_BEFORE_JUDGING)]
        assert all(p == [] for p in polls[:-1]) and [h.rank for h in polls[-1]] == [0]
        assert polls[-1][0].since_progress_s >= 0.6
        mm.close()
    rep.close()


@pytest.mark.timeout(30)
def test_ranks_waiting_in_recovery_are_not_killed_for_a_peer_stuck_in_an_old_collective(tmp_path) -> None:
    """Ranks 0 and 1 joined the next generation; rank 2 still sits in the last one's all-reduce.

    Rank 2 is the one to kill (nothing will come to its collective: it is judged as a culprit, by its own
    evidence); the two in recovery wait for it.
    """
    from monitors.hangverdict import ranks_to_kill

    run = str(tmp_path)
    writers = [ProgressReporter(run, r) for r in range(3)]
    for w in writers:
        w.enter("forward", 7, generation=0)
    writers[0].enter("recovery", 7, generation=1)  # it left generation 0: heading to the next
    writers[1].enter("recovery", 7, generation=1)
    writers[2].enter("all-reduce", 7, generation=0)
    det = HangDetector(HangConfig(computed=False, idle_timeout_s=1.0, busy_timeout_s=1.0, long_section_timeout_s=1.0),
                       run, range(3))
    later = max(_frozen_since(run, r) for r in range(3)) + 5.0
    hangs = {h.rank: h for h in det.poll(later)}
    assert hangs[2].waiting_on == () and hangs[0].waiting_on == (2,) and hangs[1].waiting_on == (2,)
    assert hangs[2].evidence != Evidence.WAITING.value
    assert ranks_to_kill(list(hangs.values()), det.config.collective_sections) == [2]
    for w in writers:
        w.close()


def _steady(writer: ProgressReporter, generation: int, steps: range) -> None:
    """Whole steps of work in ``generation`` (the first one of a generation is its "first step")."""
    for step in steps:
        for section in ("data", "forward", "backward", "all-reduce", "optimizer"):
            writer.enter(section, step, generation=generation)


@pytest.mark.timeout(30)
def test_a_rank_training_is_not_killed_while_a_peer_still_restores_into_its_generation(tmp_path) -> None:
    """Rank 1 still heals (or rebuilds its DDP) in generation 1 while rank 0 already waits in generation 1's
    all-reduce: rank 0 waits on rank 1, which has the recovery timeout. (Seen: the survivor blocked in its
    on_new_group and the two others killed as hung in all-reduce, 3 s later.)"""
    from monitors.hangverdict import ranks_to_kill

    run = str(tmp_path)
    writers = [ProgressReporter(run, r) for r in range(2)]
    for w in writers:
        _steady(w, 0, range(12))
        w.enter("recovery", 12, generation=1)
    writers[0].enter("data", 12, generation=1)
    writers[0].enter("all-reduce", 12, generation=1)
    writers[1].enter("recovery", 12, generation=1)  # healing
    det = HangDetector(HangConfig(min_observations=10, idle_timeout_s=0.1, busy_timeout_s=1.0,
                                  long_section_timeout_s=60.0), run, range(2))
    later = max(_frozen_since(run, r) for r in range(2)) + 5.0
    hangs = det.poll(later)
    assert [(h.rank, h.waiting_on, h.evidence) for h in hangs] == [(0, (1,), "waiting")]
    assert ranks_to_kill(hangs, det.config.collective_sections) == []
    for w in writers:
        w.close()


@pytest.mark.timeout(30)
def test_a_collective_is_timed_from_its_last_local_arrival(tmp_path) -> None:
    """Rank 1 was slow (its first step after a recovery, a straggler): rank 0 waited in the all-reduce
    meanwhile. When rank 1 arrives, neither is hung until the all-reduce has had both for its timeout."""

    run = str(tmp_path)
    writers = [ProgressReporter(run, r) for r in range(2)]
    det = HangDetector(HangConfig(min_observations=10, idle_timeout_s=0.2, busy_timeout_s=0.2, safety_factor=1e-9),
                       run, range(2))
    for w in writers:
        _steady(w, 0, range(12))
    writers[0].enter("all-reduce", 12, generation=0)
    time.sleep(0.3)
    writers[1].enter("all-reduce", 12, generation=0)
    arrived = _frozen_since(run, 1)
    assert _frozen_since(run, 0) < arrived - 0.25
    assert det.poll(arrived + 0.15) == []  # rank 0 has waited 0.45 s, but for 0.15 s with rank 1 there
    assert det.timeout("all-reduce") == 0.2
    hangs = det.poll(arrived + 0.25)
    assert sorted(h.rank for h in hangs) == [0, 1] and all(h.since_progress_s == pytest.approx(0.25) for h in hangs)
    for w in writers:
        w.close()


@pytest.mark.timeout(30)
def test_every_completed_section_is_an_observation_first_steps_of_a_generation_included(tmp_path) -> None:
    """A replacement's first step (cold caches) and a survivor's first collective after a recovery are long:
    learning them only makes the computed timeouts longer, so they count; a section cut short by the fault
    (the one "recovery" ends) does not."""
    run = str(tmp_path)
    w = ProgressReporter(run, 0)
    _steady(w, 0, range(12))
    w.enter("data", 12, generation=0)  # step 11 done: past generation 0's first step
    reader = ProgressReader(run, 0)
    counted = reader.read().section_count["backward"]
    w.enter("forward", 12, generation=0)
    w.enter("backward", 12, generation=0)
    w.enter("recovery", 12, generation=1)  # the fault: step 12's backward was cut short
    assert reader.read().section_count["backward"] == counted
    w.enter("recovery", 12, generation=1)  # the rendezvous, the heal
    snap = reader.read()
    assert snap.first_step and snap.generation == 1
    w.enter("data", 12, generation=1)
    w.enter("forward", 12, generation=1)
    w.enter("backward", 12, generation=1)
    time.sleep(0.2)  # a long first backward
    w.enter("all-reduce", 12, generation=1)
    snap = reader.read()
    assert snap.section_count["backward"] == counted + 1 and snap.section_max_s["backward"] >= 0.2
    det = HangDetector(HangConfig(min_observations=10, idle_timeout_s=1e-9), run, [0])
    det.poll()
    assert det.timeout("backward") >= 5 * 0.2
    w.close()


@pytest.mark.timeout(60)
def test_a_rank_stopped_inside_a_collective_is_the_one_killed(tmp_path, procs: Procs) -> None:
    """Rank 1 stops (SIGSTOP) inside step 3's all-reduce, then ranks 0 and 2 enter it: all three show the
    same collective; only the stopped process is killed."""
    from monitors.hangverdict import ranks_to_kill

    run = str(tmp_path)
    p = procs.start(train_loop, run, 1, {"hang_at": 3, "hang": "self-stop", "hang_section": "all-reduce"})
    reader = ProgressReader(run, 1)
    wait_for(lambda: (s := reader.read()) is not None and (s.section, s.step) == ("all-reduce", 3), 30.0,
             "rank 1 in step 3's all-reduce", alive=[p])
    wait_for(lambda: is_stopped(p.pid), 10.0, "rank 1 stopped")
    writers = {r: ProgressReporter(run, r) for r in (0, 2)}
    for w in writers.values():
        w.enter("all-reduce", 3)
    det = HangDetector(HangConfig(computed=False, stopped_timeout_s=0.5, busy_timeout_s=0.5), run, range(3))
    first = max(_frozen_since(run, r) for r in range(3)) + 1.0
    det.poll(first)  # the first look at the ranks' processes: rank 1 is seen stopped from here
    hangs = det.poll(first + 1.0)
    assert sorted((h.rank, h.section, h.step, h.waiting_on, h.stopped) for h in hangs) == [
        (0, "all-reduce", 3, (), False), (1, "all-reduce", 3, (), True), (2, "all-reduce", 3, (), False)]
    assert ranks_to_kill(hangs, det.config.collective_sections) == [1]
    os.kill(p.pid, signal.SIGKILL)
    for w in writers.values():
        w.close()
