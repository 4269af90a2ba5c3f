"""A store that moves (resilient_train.protocol.succession.movable): real TCPStores, a real stopped host, real gloo groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from resilient_train.protocol.succession.location import Endpoint, StoreLocation, StoreLost, announce, announced
from resilient_train.protocol.succession.movable import MovableStore
from resilient_train.protocol.succession.rules import majority

pytestmark = pytest.mark.timeout(60)


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=False)


def _location(server: dist.TCPStore, epoch: int = 0, call_s: float = 1.0) -> StoreLocation:
    return StoreLocation(Endpoint("127.0.0.1", server.port, epoch), wrap=lambda raw: dist.PrefixStore("job-x", raw),
                         timeout=timedelta(seconds=5), call_timeout_s=call_s)


def test_calls_pass_through_in_the_jobs_namespace_and_views_share_nothing_but_the_location():
    server = _server()
    store = MovableStore(_location(server))
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2
    assert store.compare_set("c", "", "x") == b"x"
    assert store.check(["a"]) and not store.check(["missing"])
    assert store.multi_get(["a", "c"]) == [b"1", b"x"]
    assert server.get("job-x/a") == b"1"  # under the namespace the location's wrap gives
    view = store.scoped("rt/gen/3/ckpt")
    view.set("k", "v")
    assert server.get("job-x/rt/gen/3/ckpt/k") == b"v"  # as PrefixStore("rt/gen/3/ckpt", store) names it
    clone = view.clone()
    assert clone.get("k") == b"v"
    with pytest.raises(dist.DistStoreError):  # a get's own timeout is not a lost store
        store.set_timeout(timedelta(seconds=0.2))
        store.get("never")
    store.set_timeout(timedelta(seconds=5))
    assert store.get("a") == b"1"


def test_a_call_to_a_stopped_host_ends_by_its_deadline_and_a_move_reconnects():
    host = subprocess.Popen([sys.executable, "-c", (
        "import sys,time,torch.distributed as d\n"
        "s=d.TCPStore('127.0.0.1',0,is_master=True,wait_for_workers=False,use_libuv=False)\n"
        "print(s.port,flush=True)\ntime.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        location = StoreLocation(Endpoint("127.0.0.1", port, 0), wrap=lambda raw: raw,
                                 timeout=timedelta(seconds=30), call_timeout_s=1.0)
        store = MovableStore(location)
        store.set("a", "1")
        os.kill(host.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(StoreLost, match="did not answer a add"):
            store.add("n", 1)  # a raw client blocks here for as long as the host is stopped
        assert time.monotonic() - t0 < 10
        with pytest.raises(StoreLost):
            store.set("b", "2")  # at once: the connection is lost until the store moves
        t0 = time.monotonic()
        with pytest.raises(StoreLost):  # a new connection to the stopped host: its handshake is never answered
            MovableStore(location).check(["a"])
        assert time.monotonic() - t0 < 15
        successor = _server()
        location.move(Endpoint("127.0.0.1", successor.port, 1))
        store.set("b", "2")
        assert successor.get("b") == b"2"
    finally:
        host.kill()
        host.wait()


def test_a_move_ends_a_wait_on_the_old_host_at_once():
    server = _server()
    location = _location(server, call_s=1.0)
    store = MovableStore(location)
    store.set_timeout(timedelta(days=1))
    raised: list[BaseException] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        try:
            store.wait(["never"])
        except BaseException as e:  # noqa: BLE001
            raised.append(e)

    store.check(["x"])  # the connection of epoch 0 exists
    t = threading.Thread(target=waiter)
    t.start()
    started.wait(5)
    deadline = time.monotonic() + 5
    while store.calls < 2 and time.monotonic() < deadline:  # the wait is under way on epoch 0's connection
        time.sleep(0.01)
    assert store.calls == 2
    successor = _server()
    location.move(Endpoint("127.0.0.1", successor.port, 1))
    t.join(timeout=5)
    assert not t.is_alive() and isinstance(raised[0], StoreLost) and "moved" in str(raised[0])


def test_a_gloo_group_forms_over_a_movable_store():
    server = _server()
    out: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        store = MovableStore(_location(server))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", store), r, 2, timeout=timedelta(seconds=20))
        t = torch.full((3,), float(r + 1))
        pg.allreduce([t]).wait()
        out[r] = t

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert torch.equal(out[0], torch.full((3,), 3.0)) and torch.equal(out[1], out[0])


def test_an_agent_announces_a_move_to_its_ranks(tmp_path):
    path = tmp_path / ".store" / "agent.json"
    assert announced(path, after=0, timeout_s=0.1) is None
    announce(path, Endpoint("10.0.0.2", 4242, 1))
    assert announced(path, after=0, timeout_s=1) == Endpoint("10.0.0.2", 4242, 1)
    assert announced(path, after=1, timeout_s=0.1) is None  # not past the epoch the rank has


@pytest.mark.parametrize("voters, present, host, expected", [
    ({0, 1, 2}, {1, 2}, 0, True),  # 2 of 3
    ({0, 1, 2}, {2}, 0, False),
    ({0, 1, 2, 3}, {0, 1}, 0, True),  # half, with the previous host
    ({0, 1, 2, 3}, {2, 3}, 0, False),  # the other half
    ({0, 1}, {1}, 0, False),  # a 2-node job: node 1 alone
    ({0, 1}, {0}, 0, True),
    ({0, 1, 2, 3}, {1, 2, 3, 9}, 0, True),  # a stranger does not count
])
def test_the_majority_rule_never_lets_two_disjoint_sides_both_form(voters, present, host, expected):
    assert majority(voters, present, host) is expected
    assert not (majority(voters, present, host) and majority(voters, voters - present, host))


def test_a_rank_follows_its_agents_move_while_the_old_host_is_stopped_and_its_generation_ends(tmp_path, monkeypatch):
    """The old host is stopped, not dead: nothing of the rank's fails. Its agent's announcement alone moves every
    connection of the process and ends the generation it watched (no next generation: the new store's)."""
    from resilient_train.protocol.store import Keys
    from resilient_train.rank.watch import GenerationWatcher

    host = subprocess.Popen([sys.executable, "-c", (
        "import sys,time,torch.distributed as d\n"
        "s=d.TCPStore('127.0.0.1',0,is_master=True,wait_for_workers=False,use_libuv=False)\n"
        "print(s.port,flush=True)\ntime.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    path = tmp_path / ".store" / "agent.json"
    monkeypatch.setenv("RT_STORE_FILE", str(path))
    try:
        port = int(host.stdout.readline())
        location = StoreLocation(Endpoint("127.0.0.1", port, 0), wrap=lambda raw: raw,
                                 timeout=timedelta(seconds=30), call_timeout_s=30.0)  # no call's deadline helps
        store = MovableStore(location)
        announce(path, location.endpoint)  # the agent's file from the start: epoch 0 moves nothing
        store.set("a", "1")
        moved_calls: list[bool] = []
        watcher = GenerationWatcher(store, rank=2, interval_s=0.1, on_moved=lambda: moved_calls.append(True))
        watcher.watch(3)
        os.kill(host.pid, signal.SIGSTOP)
        time.sleep(0.5)  # several looks at the file: nothing moved
        assert not watcher.moved.is_set() and location.epoch == 0
        successor = _server()
        announce(path, Endpoint("127.0.0.1", successor.port, 1))
        assert watcher.moved.wait(5), "the generation of the old store did not end"
        assert watcher.next_generation is None  # the new store's current generation, whichever it is
        assert watcher.wait_handled(5) and moved_calls == [True]
        assert location.epoch == 1
        assert successor.get(Keys.supervised(2)) == str(os.getpid()).encode()  # supervised there again
        store.set("b", "2")  # the main connection follows too
        assert successor.get("b") == b"2"
        watcher.watch(7)  # the next generation is watched on the new store
        successor.set(Keys.wake(7, 2), "x")
        deadline = time.monotonic() + 5
        while not watcher.moved.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watcher.moved.is_set() and watcher.next_generation == 8
        watcher.close()
    finally:
        host.kill()
        host.wait()
