"""The watcher thread: notices a generation declared failed, or the job stopped, while the main thread computes."""

from __future__ import annotations

import threading
from typing import Callable

import torch.distributed as dist

from resilient_train.store import Keys, current_generation

__all__ = ["GenerationWatcher"]


class GenerationWatcher:
    """Polls the store; once the generation moves past :attr:`generation` (or the
    job is stopped), sets :attr:`moved` and calls ``on_moved`` (the NCCL abort).

    The main thread checks :attr:`moved` at every phase boundary and at the
    commit. ``moved`` is set *before* ``on_moved`` runs, so a main thread
    released by the abort always finds it set.
    """

    def __init__(
        self, store: dist.Store, *, rank: int, interval_s: float, on_moved: Callable[[], None] = lambda: None
    ) -> None:
        self.generation = -1
        self.moved = threading.Event()
        self.handled = threading.Event()  # on_moved returned (the abort is over): the groups may be released
        self.stopped = threading.Event()
        self._store = store.clone()  # its own connection: the main thread's may be mid-request
        self._interval_s = interval_s
        self._on_moved = on_moved
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rt-watch-rank{rank}", daemon=True)
        self._thread.start()

    def watch(self, generation: int) -> None:
        """Starts watching a newly joined generation."""
        self.generation = generation
        self.moved.clear()
        self.handled.clear()

    def wait_handled(self, timeout: float) -> bool:
        """Waits until the watcher has acted on the move of the watched generation (its NCCL abort is over).

        The main thread releases the groups only then: an abort still iterating
        over them on this thread would otherwise race their destruction.
        """
        return self.handled.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            g = self.generation
            if self.moved.is_set():
                continue
            try:
                stopped = self._store.check([Keys.STOP])
                moved = g >= 0 and current_generation(self._store) > g
            except Exception:  # noqa: BLE001  (the store is briefly unreachable: look again next time)
                continue
            if stopped:
                self.stopped.set()
            if (moved and g == self.generation) or stopped:
                self.moved.set()
                try:
                    self._on_moved()
                finally:
                    self.handled.set()
