"""The watcher thread: notices a generation declared failed, or the job stopped, while the main thread computes.

It does not poll. It waits, on a connection of its own, for its rank's wake
key of the generation it watches (``Keys.wake(g, rank)``), which the store
answers the moment whoever fails the generation, or stops the job, sets every
rank's wake key in one ``multi_set`` (:func:`resilient_train.store.interrupt_generation`).
A job of N ranks puts no load on the store while nothing fails, and one
request per rank when something does.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from resilient_train.store import Keys

__all__ = ["GenerationWatcher"]

_LONG = timedelta(days=365)  # the wait ends when the key is set, the store goes, or close() sets it
_IDLE_S = 1.0  # a watcher with nothing to watch looks again this often (thousands of ranks in one process: the bench)


class GenerationWatcher:
    """Waits on the store; once the generation it watches is interrupted (failed, or the job
    stopped), sets :attr:`moved` and calls ``on_moved`` (the NCCL abort). Which of the two it was
    is the main thread's to read (``read_stop``), when it judges the failure.

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
        self._main = store  # close() wakes the thread through it
        self._store = store.clone()  # its own connection: its wait blocks it
        self._interval_s = interval_s
        self._on_moved = on_moved
        self._stop = threading.Event()
        self._armed = threading.Event()  # watch() or close() was called
        self._lock = threading.Lock()
        self._waiting: int | None = None  # the generation whose wake key the thread waits on
        self._thread = threading.Thread(target=self._loop, name=f"rt-watch-rank{rank}", daemon=True)
        self._thread.start()

    def watch(self, generation: int) -> None:
        """Starts watching a newly joined generation."""
        self.generation = generation
        self.moved.clear()
        self.handled.clear()
        self._armed.set()

    def wait_handled(self, timeout: float) -> bool:
        """Waits until the watcher has acted on the move of the watched generation (its NCCL abort is over).

        The main thread releases the groups only then: an abort still iterating
        over them on this thread would otherwise race their destruction.
        """
        return self.handled.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stop.set()
            waiting = self._waiting
        self._armed.set()
        if waiting is not None:
            try:
                self._main.set(Keys.wake(waiting, self._rank), "closed")
            except Exception:  # noqa: BLE001  (the store is gone: so is the thread's wait)
                pass
        self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            g = self.generation
            if g < 0 or self.moved.is_set():
                # Until watch() or close(): it sets the generation before the event, which is cleared before
                # the generation is read again, so no call is missed.
                self._armed.wait(_IDLE_S)
                self._armed.clear()
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self._waiting = g
            try:
                self._store.wait([Keys.wake(g, self._rank)], _LONG)
            except Exception:  # noqa: BLE001  (the store is briefly unreachable: look again)
                self._stop.wait(self._interval_s)
                continue
            finally:
                with self._lock:
                    self._waiting = None
            if self._stop.is_set():
                return
            if g != self.generation:
                continue  # the main thread joined a newer generation meanwhile: watch that one
            self.moved.set()
            try:
                self._on_moved()
            finally:
                self.handled.set()
