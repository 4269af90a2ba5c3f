"""The coordination store: key names, connection, and waits with deadlines.

Every key of the runtime lives under ``rt/`` and, where it belongs to one
generation, carries that generation in its name, so nothing a finished
generation left behind is ever read by the next one.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["Keys", "StoreTimeout", "attempt_store", "connect", "declare_fault", "read_fault", "current_generation", "wait_until"]


class StoreTimeout(TimeoutError):
    """A wait on the store ran past its deadline."""


class Keys:
    """Named key templates."""

    GENERATION = "rt/generation"
    FINAL = "rt/final"  # set once the final state is committed

    @staticmethod
    def fault(g: int) -> str:
        return f"rt/fault/{g}"

    @staticmethod
    def joined(g: int) -> str:
        return f"rt/gen/{g}/joined"

    @staticmethod
    def member(g: int, rank: int) -> str:
        return f"rt/gen/{g}/member/{rank}"

    @staticmethod
    def pg_prefix(g: int) -> str:
        return f"rt/gen/{g}/pg"

    @staticmethod
    def done(g: int) -> str:
        return f"rt/gen/{g}/done"

    @staticmethod
    def local_state(rank: int, slot: int) -> str:
        return f"rt/local/{rank}/{slot}"

    @staticmethod
    def supervised(rank: int) -> str:
        return f"rt/supervised/{rank}"

    @staticmethod
    def chaos_fired(index: int) -> str:
        return f"rt/chaos/fired/{index}"


def connect(host: str, port: int, *, timeout: timedelta = timedelta(seconds=60)) -> dist.TCPStore:
    """A client of the store that the agent (or torchrun's rank 0) hosts."""
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)


def attempt_store(store: dist.Store, attempt: int) -> dist.Store:
    """The keys of one launcher attempt (torchrun's restart count)."""
    return dist.PrefixStore(f"attempt/{attempt}", store)


def current_generation(store: dist.Store) -> int:
    if not store.check([Keys.GENERATION]):
        store.compare_set(Keys.GENERATION, "", "0")
    return int(store.get(Keys.GENERATION))


def declare_fault(store: dist.Store, generation: int, cause: dict[str, Any]) -> bool:
    """Marks ``generation`` as failed and moves the run to the next one.

    The agent (a worker died) and the ranks (a step raised) do the same thing,
    so a run under plain torchrun recovers with the same protocol. Idempotent:
    the first cause is kept and the generation moves only once. Returns whether
    this call was the first to report the fault.
    """
    payload = json.dumps(cause, default=str)
    first = store.compare_set(Keys.fault(generation), "", payload).decode() == payload
    store.compare_set(Keys.GENERATION, str(generation), str(generation + 1))
    return first


def read_fault(store: dist.Store, generation: int) -> dict[str, Any] | None:
    key = Keys.fault(generation)
    if not store.check([key]):
        return None
    return json.loads(store.get(key))


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    interval: float = 0.005,
    max_interval: float = 0.05,
) -> None:
    """Polls ``predicate`` with a growing interval until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    delay = interval
    while not predicate():
        if time.monotonic() > deadline:
            raise StoreTimeout(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, max_interval)
