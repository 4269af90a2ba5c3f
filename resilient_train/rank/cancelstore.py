"""The store a generation's gloo group is built on: its waits end when the generation is declared failed.

Building a gloo group, every rank publishes its address under the group's keys
and waits for every other's (gloo's full-mesh connect, through the store's
``wait`` and ``get``). A rank lost in that window never publishes, and its
peers used to sit in a C++ wait for the group's whole timeout
(``SupervisorConfig.pg_timeout_s``, 30 s) while the agent had long moved the
run on: a SIGKILL at the rendezvous cost 29.9 s of detection. Behind this
store a wait looks at the key and at ``cancelled`` (the watcher's ``moved``:
the generation was declared failed) in turns, and raises
:class:`~resilient_train.rank.errors.GenerationFailed` once it is set, so the
build fails within a few milliseconds of the wake.

It is a Python subclass of ``torch.distributed.Store`` (c10d calls it through
pybind11's trampoline): c10d keeps only the C++ half alive, so every such
object is kept here for the life of the process (one per generation, and the
clones c10d asks for; none opens a connection of its own but a clone). Only
gloo groups use it: NCCL's watchdog threads call their store from C++
threads, which would wait for the GIL.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from resilient_train.rank.errors import GenerationFailed

__all__ = ["CancellableStore"]

_POLL_FIRST_S = 0.001  # a key usually lands within milliseconds: look again soon, then less often
_POLL_MAX_S = 0.05
_ALIVE: list["CancellableStore"] = []  # c10d holds the C++ half only: a Python half collected breaks every call


class CancellableStore(dist.Store):
    """``inner`` with waits that end when ``cancelled`` is set (``what`` names the wait in the error)."""

    def __init__(self, inner: dist.Store, cancelled: threading.Event, *, what: str) -> None:
        super().__init__()
        self._inner, self._cancelled, self._what = inner, cancelled, what
        _ALIVE.append(self)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (self._inner.timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = _POLL_FIRST_S
        while not self._inner.check(keys):
            if self._cancelled.is_set():
                raise GenerationFailed(f"{self._what}: the generation was declared failed while waiting for {keys}")
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"{self._what}: wait timeout after {limit:.0f} s, keys: {keys}")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self._inner.multi_get(keys)

    def set(self, key: str, value: bytes) -> None:
        self._inner.set(key, value)

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._inner.multi_set(keys, values)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def append(self, key: str, value: bytes) -> None:
        self._inner.append(key, value)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    def clone(self) -> "CancellableStore":
        return CancellableStore(self._inner.clone(), self._cancelled, what=self._what)
