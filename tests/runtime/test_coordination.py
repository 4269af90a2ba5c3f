"""The coordination protocol at N = 64 simulated ranks, through bench/coordination.py's own code path.

Real store server and client processes, the runtime's own protocol functions;
the assertions are on outcomes (every rank agreed on one plan, the right ranks
heal), never on timings.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from resilient_train.protocol.store import Keys

_PATH = Path(__file__).resolve().parents[2] / "bench" / "coordination.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_coordination", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_64_ranks_agree_through_two_generation_changes() -> None:
    bench = _bench()
    out = bench.run_size(bench.BenchConfig(world_size=64, procs=2, steady_steps=2, step_s=0.2, timeout_s=60.0))
    # run_size raises unless all 64 ranks reported one and the same plan in every phase
    assert out["start"]["plan"][:3] == [0, "start", None]
    one, pct = out["one_lost"]["plan"], out["pct_lost"]["plan"]
    lost_a, lost_b = bench._Bench.lost_sets(64)
    assert one[:2] == [1, "live"] and one[2] == 2  # the boundary every survivor holds
    assert sorted(t for t, _ in one[3]) == lost_a and one[5] == lost_a  # only the replacement heals
    assert all(f not in lost_a for _, f in one[3])
    assert pct[:3] == [2, "live", 3] and sorted(t for t, _ in pct[3]) == lost_b and pct[5] == lost_b
    assert out["one_lost"]["ops_per_rank"] < 64  # O(1) requests per rank, not O(N)
    # A survivor: its watcher's wait, its membership, the plan's get (2 round trips); rank 0 and the agent
    # add a few, spread over 64 ranks. Anything more is a call someone put back on every rank.
    assert out["one_lost"]["trips_per_rank"] <= 5
    # A step: the local state's publish. A watcher that arms for generation 0 after the join's meter reading
    # lands its one wait in the steady window (seen in CI: 1.05), so not exactly one.
    assert out["steady"]["ops_per_rank"] < 1.5


@pytest.mark.timeout(60)
def test_a_failed_generation_settles_its_join_for_everyone() -> None:
    import torch.distributed as dist

    from resilient_train.protocol.store import current_generation, report_fault

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert current_generation(store) == 0
    first, cause = report_fault(store, 0, {"rank": 3, "kind": "exit"}, world_size=4)
    again, same = report_fault(store, 0, {"rank": 1, "kind": "late"}, world_size=4)
    assert first and not again and cause == same == {"rank": 3, "kind": "exit"}
    assert current_generation(store) == 1
    assert store.get(Keys.settled(0)).decode() == Keys.FAILED
    assert store.check([Keys.wake(0, r) for r in range(4)])


# ---- the protocol's pieces on a real store (the agent's kind: TCPStore without libuv) and real threads ----

def _store():
    import torch.distributed as dist

    from resilient_train.protocol.store import job_store

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False)
    return server, lambda: job_store(dist.TCPStore("127.0.0.1", server.port, is_master=False), "t")


class _Stopped(Exception):
    pass


def _raise_if_stopped(store):
    """The ``stopped`` callback a join takes: raises once the job's stop is in ``store``."""
    from resilient_train.protocol.store import read_stop

    def stopped() -> None:
        if read_stop(store) is not None:
            raise _Stopped()
    return stopped


def _member(rank: int, live: int | None):
    import os

    from resilient_train.rank.generation import RankMembership

    return RankMembership(rank=rank, pid=os.getpid(), live_step=live, snapshot_step=None,
                      local_steps=[] if live is None else [live], replacement=False)


@pytest.mark.timeout(60)
def test_a_woken_rank_joins_the_next_generation_without_asking() -> None:
    import threading

    from resilient_train.rank import rendezvous
    from resilient_train.rank.watch import GenerationWatcher

    _server, connect = _store()
    agent = connect()
    world = 3
    stores = [connect() for _ in range(world)]
    watchers = [GenerationWatcher(s, rank=r, interval_s=0.05) for r, s in enumerate(stores)]
    try:
        for w in watchers:
            w.watch(0)
        cause = {"rank": 2, "kind": "worker_exit", "time": 1.0}
        assert rendezvous.report_fault(agent, 0, cause, world_size=world) == (True, cause)
        plans: dict[int, object] = {}

        def rank(r: int) -> None:
            assert watchers[r].moved.wait(20)
            first, standing, moved_to = rendezvous.leave_generation(
                stores[r], 0, {"rank": r, "kind": "GenerationFailed"}, world_size=world, watcher=watchers[r])
            assert (first, standing, moved_to) == (False, None, 1)  # nothing asked of the store
            plans[r] = rendezvous.enter_generation(stores[r], world_size=world, me=lambda: _member(r, 5),
                                                   timeout=20, stopped=lambda: None, moved_to=moved_to)
            watchers[r].watch(1)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert {r: (p.generation, p.step, p.cause) for r, p in plans.items()} == {r: (1, 5, cause) for r in range(world)}
        # The watchers already wait on generation 1's keys: the next fault wakes them, to join generation 2.
        rendezvous.report_fault(agent, 1, {"rank": 0, "kind": "worker_exit"}, world_size=world)
        assert all(w.moved.wait(20) and w.next_generation == 2 for w in watchers)
    finally:
        for w in watchers:
            w.close()


@pytest.mark.timeout(60)
def test_a_stopped_job_wakes_its_ranks_into_a_join_that_tells_them_so() -> None:
    """A watcher only waits for its wake key: every wake sends the rank to the next generation. A stop fails
    that join before it wakes anyone, so the rank, having asked nothing, learns of the stop there."""
    from resilient_train.rank import rendezvous
    from resilient_train.protocol.store import interrupt_for_stop, request_stop
    from resilient_train.rank.watch import GenerationWatcher

    _server, connect = _store()
    store = connect()
    rank_store = connect()
    watcher = GenerationWatcher(connect(), rank=0, interval_s=0.05)
    try:
        watcher.watch(0)
        request_stop(store, {"summary": "a bug", "exit_code": 1})
        interrupt_for_stop(store, world_size=2)
        assert watcher.moved.wait(20) and watcher.next_generation == 1
        assert store.get(Keys.outcome(1)).decode() == Keys.FAILED  # settled before the wake: nothing waits
        assert rendezvous.stop_after_failure(rank_store, watcher) is None  # a woken rank reads nothing
        _, _, moved_to = rendezvous.leave_generation(rank_store, 0, {"rank": 0}, world_size=2, watcher=watcher)
        with pytest.raises(_Stopped):
            rendezvous.enter_generation(rank_store, world_size=2, me=lambda: _member(0, 3), timeout=30,
                                        stopped=_raise_if_stopped(rank_store), moved_to=moved_to)
    finally:
        watcher.close()


@pytest.mark.timeout(60)
def test_a_stop_that_read_the_generation_before_a_fault_moved_it_still_ends_the_next_join() -> None:
    """The stopper interrupts generation 0; a fault then moves the run to 1. Ranks woken by the fault join 1
    without looking: the fault's reporter sees the stop and fails 1, so the join ends at once, as stopped."""
    from resilient_train.rank import rendezvous
    from resilient_train.protocol.store import interrupt_generation, request_stop

    _server, connect = _store()
    store = connect()
    request_stop(store, {"summary": "a bug", "exit_code": 1})
    interrupt_generation(store, 0, world_size=2)  # the stopper's wake of generation 0 alone (not its fail of 1)
    rendezvous.report_fault(store, 0, {"rank": 1, "kind": "worker_exit"}, world_size=2)

    with pytest.raises(_Stopped):
        rendezvous.enter_generation(connect(), world_size=2, me=lambda: _member(0, 3), timeout=30,
                                    stopped=_raise_if_stopped(store), moved_to=1)


@pytest.mark.timeout(60)
def test_a_generation_that_fails_while_it_assembles_ends_the_planners_wait() -> None:
    import threading

    from resilient_train.rank import rendezvous
    from resilient_train.rank.generation import PLANNER

    _server, connect = _store()
    agent = connect()
    out: dict[str, object] = {}

    def planner() -> None:  # joins generation 0 alone: rank 1 never comes to it
        out["plan"] = rendezvous.enter_generation(connect(), world_size=2, me=lambda: _member(PLANNER, 7),
                                                  timeout=40, stopped=lambda: None)

    t = threading.Thread(target=planner)
    t.start()
    t.join(1.0)
    assert t.is_alive()  # waiting for rank 1's membership
    rendezvous.report_fault(agent, 0, {"rank": 1, "kind": "worker_exit"}, world_size=2)
    # Generation 0 failed: the planner's wait ended with it, and it joined generation 1, where rank 1 comes.
    plan = rendezvous.enter_generation(connect(), world_size=2, me=lambda: _member(1, 7), timeout=20,
                                       stopped=lambda: None)
    t.join(20)
    assert plan.generation == 1 and plan.step == 7
    assert out["plan"] == plan


def _interruptible_join(connect, *, rank: int, world: int, requested, interrupt, stopped=lambda: None):
    """A rank's join as the supervisor makes it: on its own connection, waited on in slices. Its timeout (600 s)
    is past every test's: a join that only ended by its deadline fails the test by pytest's timeout."""
    from resilient_train.rank import rendezvous

    return rendezvous.join_interruptibly(
        lambda: rendezvous.enter_generation(connect(), world_size=world, me=lambda: _member(rank, 4), timeout=600,
                                            stopped=stopped),
        requested=requested, interrupt=interrupt)


@pytest.mark.timeout(60)
def test_a_preemption_signal_ends_a_join_that_no_peer_will_finish(monkeypatch) -> None:
    """Rank 0 joins a 2-rank generation alone (its peer died; under plain torchrun nobody replaces it) and a
    real SIGUSR1 arrives: the main thread, waiting on the join in slices, runs the handler, and once the
    preemption is overdue it stops the job, which ends the join as stopped rather than at its timeout."""
    import os
    import signal
    import threading
    import time

    from resilient_train.rank import preempt
    from resilient_train.protocol.store import interrupt_for_stop, request_stop

    monkeypatch.setattr(preempt, "JOIN_WAIT_S", 0.2)
    _server, connect = _store()
    store = connect()
    preemption = preempt.Preemption(preempt.PreemptionConfig(signals=("SIGUSR1",)))
    interrupts: list[str | None] = []

    def interrupt() -> None:
        interrupts.append(preemption.signal)
        request_stop(store, {"rank": 0, "summary": "preempted", "exit_code": 75})
        interrupt_for_stop(store, world_size=2)

    t0 = time.monotonic()
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(_Stopped):
            _interruptible_join(connect, rank=0, world=2, requested=lambda: preemption.overdue_in_join(since=t0),
                                interrupt=interrupt, stopped=_raise_if_stopped(store))
    finally:
        timer.cancel()
        timer.join()
        preemption.close()
    assert interrupts == ["SIGUSR1"]  # once, with the signal the handler saw


@pytest.mark.timeout(60)
def test_a_join_counts_its_preemption_wait_from_the_later_of_the_signal_and_its_start() -> None:
    """A signal that came during a long step (long before the join) still gives the join its JOIN_WAIT_S."""
    import time

    from resilient_train.rank import preempt

    p = preempt.Preemption(preempt.PreemptionConfig(signals=()))
    now = time.monotonic()
    assert not p.overdue_in_join(since=now - 60)  # no signal: never overdue
    p.request("SIGTERM")
    p.requested_at = now - 60  # the signal came a minute ago
    assert not p.overdue_in_join(since=now)  # the join began just now: its wait is still ahead
    assert p.overdue_in_join(since=now - preempt.JOIN_WAIT_S)  # it began a JOIN_WAIT_S ago
    p.requested_at = now  # the signal came now, in a join begun a minute ago
    assert not p.overdue_in_join(since=now - 60)


@pytest.mark.timeout(60)
def test_a_preemption_signal_leaves_a_join_that_completes_to_its_plan(monkeypatch) -> None:
    """The signal comes while the peer is on its way (a warm spare's replacement): the join completes before
    the preemption is overdue (JOIN_WAIT_S is made long here, so the box's speed cannot matter), returns its
    plan and nothing stops the job (the stop then rides the next step's vote)."""
    import signal
    import threading
    import time

    from resilient_train.rank import preempt

    monkeypatch.setattr(preempt, "JOIN_WAIT_S", 600.0)
    _server, connect = _store()
    preemption = preempt.Preemption(preempt.PreemptionConfig(signals=("SIGUSR1",)))
    plans: dict[int, object] = {}
    signal.raise_signal(signal.SIGUSR1)  # its handler has run when this returns
    assert preemption.signal == "SIGUSR1"
    peer = threading.Thread(target=lambda: plans.__setitem__(1, _interruptible_join(
        connect, rank=1, world=2, requested=lambda: False, interrupt=lambda: None)))
    peer.start()
    t0 = time.monotonic()
    try:
        plans[0] = _interruptible_join(connect, rank=0, world=2,
                                       requested=lambda: preemption.overdue_in_join(since=t0),
                                       interrupt=lambda: pytest.fail("stopped a join that completed"))
    finally:
        peer.join(30)
        preemption.close()
    assert {r: (p.generation, p.step) for r, p in plans.items()} == {0: (0, 4), 1: (0, 4)}


@pytest.mark.timeout(60)
def test_a_failed_interrupt_waits_for_the_join_then_raises() -> None:
    """interrupt() raised (the store did not take the stop): no thread is left behind on the join's connection;
    the join is awaited (its peer, started by the interrupt, comes) and the interrupt's error is raised after."""
    import threading

    _server, connect = _store()
    plans: dict[int, object] = {}
    peer = threading.Thread(target=lambda: plans.__setitem__(1, _interruptible_join(
        connect, rank=1, world=2, requested=lambda: False, interrupt=lambda: None)))

    def interrupt() -> None:
        peer.start()  # rank 0's join is under way: the peer comes only now
        raise RuntimeError("the store did not take the stop")

    try:
        with pytest.raises(RuntimeError, match="did not take the stop"):
            _interruptible_join(connect, rank=0, world=2, requested=lambda: True, interrupt=interrupt)
    finally:
        if peer.is_alive():
            peer.join(30)
    assert 1 in plans  # the peer's join completed: rank 0's join was still there for it
    assert not [t for t in threading.enumerate() if t.name == "rt-join"]  # no join left on its connection
