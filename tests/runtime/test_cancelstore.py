"""The store a generation's gloo group is built on (resilient_train.rank.cancelstore), against a real TCPStore and a
real gloo build whose peer never comes: the build ends at the wake, not at the group's timeout."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from resilient_train.rank.cancelstore import CancellableStore
from resilient_train.rank.errors import GenerationFailed
from resilient_train.rank.group import build_group, destroy_group

LONG_S = 600.0  # the group's own timeout: far past the test's, so only the wake can end the build


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=LONG_S), wait_for_workers=False)


class _Announcing(CancellableStore):
    """Says when gloo's build first waits on it (for the test to wake it then, not before)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = threading.Event()

    def wait(self, keys, timeout=None) -> None:
        self.waiting.set()
        super().wait(keys, timeout)


@pytest.mark.timeout(60)
def test_a_group_build_waiting_for_a_lost_peer_ends_at_the_wake():
    moved = threading.Event()
    store = _Announcing(_server(), moved, what="building generation 7's group")
    failure: list[BaseException] = []

    def build() -> None:
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore("gen/7/pg", store), rank=0, world_size=2,
                                    timeout=timedelta(seconds=LONG_S))
        except BaseException as e:  # noqa: BLE001  (the test reads it)
            failure.append(e)

    thread = threading.Thread(target=build, name="build")
    thread.start()
    assert store.waiting.wait(30), failure  # rank 0 published its address and waits for rank 1's
    moved.set()  # the watcher's wake: the generation was declared failed
    thread.join(30)
    assert not thread.is_alive(), "the build did not end at the wake"
    (error,) = failure
    assert isinstance(error, GenerationFailed), repr(error)
    assert "building generation 7's group: the generation was declared failed while waiting for" in str(error)
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_build_group_builds_gloo_on_it():
    """The wiring: build_group puts a gloo group's store behind one (a world of one needs no peer)."""
    moved = threading.Event()
    group = build_group(_server(), 3, rank=0, world_size=1, backend="gloo", timeout_s=30, device=torch.device("cpu"),
                        cancelled=moved)
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    assert t.tolist() == [1.0, 1.0]
    from resilient_train.rank import cancelstore

    assert cancelstore._ALIVE and cancelstore._ALIVE[-1]._cancelled is moved
    destroy_group(torch.device("cpu"))


@pytest.mark.timeout(60)
def test_its_waits_end_on_the_key_and_time_out_like_the_store():
    inner = _server()
    store = CancellableStore(inner, threading.Event(), what="a test")
    threading.Timer(0.2, lambda: inner.set("k", b"v")).start()
    assert store.get("k") == b"v"  # a get waits for its key, as the store's own does
    store.set("a", b"1")
    assert store.multi_get(["a", "k"]) == [b"1", b"v"] and store.add("n", 2) == 2 and store.check(["a"])
    with pytest.raises(dist.DistStoreError, match=r"a test: wait timeout after 0 s, keys: \['never'\]"):
        store.wait(["never"], timedelta(seconds=0.3))
