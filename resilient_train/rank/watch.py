"""The watcher thread: notices a generation declared failed, or the job stopped, while the main thread computes.

It does not poll. It waits, on a connection of its own, for its rank's wake
key of the generation it watches (``Keys.wake(g, rank)``), which the store
answers the moment whoever fails the generation, or stops the job, sets
every rank's wake key in one ``multi_set``
(:func:`resilient_train.protocol.store.interrupt_generation`). A wake always means
"join the next generation" (:attr:`GenerationWatcher.next_generation`): a
fault moved the run there, and a stop failed that join before waking anyone,
so the rank asks the store nothing more either way. A job of N ranks puts no
load on the store while nothing fails, and one round trip per rank when
something does.

Under an agent of a many-node job it also follows the agent to the store's
next host (resilient_train.rank.storefollow.MoveNotice): the generation it
watches is gone with the old store, which is marked as a wake would, with
no next generation to join but the new store's current one.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from resilient_train.rank.fence import check_fence
from resilient_train.protocol.store import Keys
from resilient_train.rank.storefollow import MoveNotice

__all__ = ["GenerationWatcher"]

_LONG = timedelta(days=365)  # the wait ends when the key is set, the store goes, or close() sets it
_IDLE_S = 1.0  # a watcher with nothing to watch looks again this often (thousands of ranks in one process: the bench)


class GenerationWatcher:
    """Waits on the store; once the generation it watches is interrupted (failed, or the job
    stopped), sets :attr:`moved` and calls ``on_moved`` (the NCCL abort). Which of the two it was,
    the rank learns by joining the next generation (a stop has failed that join).

    The main thread checks :attr:`moved` at every phase boundary and at the
    commit. ``moved`` is set *before* ``on_moved`` runs, so a main thread
    released by the abort always finds it set. ``interval_s`` is how long it
    waits before looking again after a store error.
    """

    def __init__(
        self, store: dist.Store, *, rank: int, interval_s: float, on_moved: Callable[[], None] = lambda: None
    ) -> None:
        self.generation = -1
        self.moved = threading.Event()
        self.handled = threading.Event()  # on_moved returned (the abort is over): the groups may be released
        self._rank = rank
        self.next_generation: int | None = None  # once moved: the generation to join (the watched one + 1)
        self._main = store  # close() wakes the thread through it
        self._store = store.clone()  # its own connection: its wait blocks it
        self._store.set_timeout(_LONG)  # its wait ends when the key is set, the store goes, or close() sets it
        self._interval_s = interval_s
        self._on_moved = on_moved
        self._stop = threading.Event()
        self._armed = threading.Event()  # watch() or close() was called
        self._lock = threading.Lock()
        self._waiting: int | None = None  # the generation whose wake key the thread waits on
        self._thread = threading.Thread(target=self._loop, name=f"rt-watch-rank{rank}", daemon=True)
        self._thread.start()
        self._notice = MoveNotice.for_store(store, rank=rank, on_move=self._store_moved)

    def watch(self, generation: int) -> None:
        """Starts watching a newly joined generation.

        The thread usually waits on its key already: once woken it waits on the
        key of the next generation, the one this rank then joins.
        """
        with self._lock:
            self.generation = generation
            self.next_generation = None
            self.moved.clear()
            self.handled.clear()
            stale = self._waiting if self._waiting is not None and self._waiting != generation else None
        self._armed.set()
        if stale is not None:  # it waits on a generation this rank did not join (that one failed first): move it
            self._kick(stale, "rearm")

    def wait_handled(self, timeout: float) -> bool:
        """Waits until the watcher has acted on the move of the watched generation (its NCCL abort is over).

        The main thread releases the groups only then: an abort still iterating
        over them on this thread would otherwise race their destruction.
        """
        return self.handled.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if self._notice is not None:
            self._notice.close()
        with self._lock:
            self._stop.set()
            waiting = self._waiting
        self._armed.set()
        if waiting is not None:
            self._kick(waiting, "closed")
        self._thread.join(timeout)

    def _store_moved(self) -> None:
        """The notice's thread: the store moved (every connection follows it); the watched generation, which
        lived in the old store, is over: the rank joins the new store's current one (no next generation)."""
        with self._lock:
            if self.generation < 0 or self.moved.is_set():
                return
            self.next_generation = None
            self.moved.set()
        try:
            self._on_moved()
        finally:
            self.handled.set()

    def _kick(self, generation: int, why: str) -> None:
        """Ends the thread's wait on ``generation``'s key, a key the thread treats as spent (nothing moved)."""
        try:
            self._main.set(Keys.wake(generation, self._rank), why)
        except Exception:  # noqa: BLE001  (the store is gone: so is the thread's wait)
            pass

    def _loop(self) -> None:
        spent: int | None = None  # a wait on the next generation's key that ended before this rank joined it
        while True:
            with self._lock:
                if self._stop.is_set():
                    return
                if self.generation >= 0 and not self.moved.is_set():
                    target: int | None = self.generation
                elif self.moved.is_set() and self.next_generation is not None and self.next_generation != spent:
                    # Moved: wait now on the key of the next generation, which this rank is about to join, so
                    # that watch() finds the wait in place and no thread has to wake for it.
                    target = self.next_generation
                else:
                    target = None
                self._waiting = target
            if target is None:
                # Until watch() or close(): they change the state before setting the event, and the state is
                # read again after every wake, so no call is missed.
                self._armed.wait(_IDLE_S)
                self._armed.clear()
                continue
            try:
                self._store.wait([Keys.wake(target, self._rank)])  # one round trip: the value says nothing
            except Exception:  # noqa: BLE001  (the store is briefly unreachable: look again)
                with self._lock:
                    self._waiting = None
                self._stop.wait(self._interval_s)
                continue
            with self._lock:
                self._waiting = None
                if self._stop.is_set():
                    return
                if target != self.generation or self.moved.is_set():
                    # The rank has not joined ``target`` (it failed while the rank joined: the join sees that
                    # itself), or it moved past it: wait for watch().
                    spent = target
                    continue
                # A lost node's ranks learn it here, whatever the main thread is doing (resilient_train.rank.fence):
                # the claim of the loss is set before the generation fails, which woke this thread.
                try:
                    check_fence(self._store, "woken")
                except Exception:  # noqa: BLE001  (the store went: the join will say so)
                    pass
                self.next_generation = target + 1
                self.moved.set()
            try:
                self._on_moved()
            finally:
                self.handled.set()
