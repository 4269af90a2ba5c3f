"""Completion of a save across ranks, agreed through a c10d Store (not a process group).

The runtime may tear down its process groups after a fault while a save is in
flight, and the store (hosted by the agent) outlives any rank. Keys, under
``{prefix}/{step}/``: ``rank/{r}`` each rank's report (its files, or its error),
``arrived`` a counter, ``all`` set by the last rank to arrive, ``outcome`` set by
rank 0 once it committed or gave up. Pass a store namespaced by generation
(e.g. a ``PrefixStore``) so a step saved again after a restart starts clean.
A save with a ``tag`` (a preemption's) has keys of its own, under
``{prefix}/{tag}/{step}/``: the step may have been saved already in this store
(its periodic save skipped, failed or committed), and a save reading an earlier
one's ``all`` and ``outcome`` would commit, or say committed, before every rank
wrote it.

The committer waits on the store; a TCPStore client serves one request at a
time, so the coordinator works on its own connection (``Store.clone()``) and
never stalls the caller's heartbeats or rendezvous on the shared one.

A save that lost a rank can never complete: waiting the full timeout for it
would freeze checkpointing (every later save skipped) and the job's exit. So
the waits on other ranks poll the store (at most ``POLL_S`` apart) and, between
polls, ask ``cancelled`` (the runtime's "this generation was declared failed");
once it says so, the wait raises :class:`SaveCancelled` at once. A rank that
skips a step (its previous save still in flight) says so under ``skipped``:
the others give that step up too, at once.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Union

import torch.distributed as dist

__all__ = ["POLL_S", "Cancelled", "Report", "SaveCancelled", "StoreCoordinator"]

Report = dict[str, Any]  # {"files": {...}, "local_tree": {...}} or {"error": "...", "storage": kind or None}
Cancelled = Union[Callable[[], bool], threading.Event]
POLL_S = 0.1  # how often a wait on other ranks asks whether the save was cancelled


class SaveCancelled(RuntimeError):
    """The caller's ``cancelled`` said the save cannot complete (a rank was lost)."""


class StoreCoordinator:
    """One generation's view: the store the save's keys live in, and its ``cancelled`` predicate.

    Immutable: a save keeps the coordinator it was requested under, so a save still in flight
    when the next generation begins finishes (or is cancelled) on its own generation's keys.
    """

    def __init__(
        self, store: dist.Store | None, *, rank: int, world_size: int, prefix: str, cancelled: Cancelled | None = None,
    ) -> None:
        if store is None and world_size > 1:
            raise ValueError("CheckpointManager: world_size > 1 needs a store to coordinate commits")
        if cancelled is not None and not (callable(cancelled) or isinstance(cancelled, threading.Event)):
            raise ValueError(f"CheckpointManager: cancelled must be a callable or a threading.Event, got {cancelled!r}")
        self._store = _own_connection(store)
        self._rank = rank
        self._world = world_size
        self._prefix = prefix
        self._cancelled = cancelled
        self._local: dict[int, Report] = {}

    def rebound(self, store: dist.Store, cancelled: Cancelled | None) -> StoreCoordinator:
        """The coordinator for later saves (e.g. the next generation's prefix store)."""
        return StoreCoordinator(store, rank=self._rank, world_size=self._world, prefix=self._prefix,
                                cancelled=cancelled)

    def is_cancelled(self) -> bool:
        c = self._cancelled
        if c is None:
            return False
        return c.is_set() if isinstance(c, threading.Event) else bool(c())

    def _wait(self, key: str, timeout: float, what: Callable[[], str]) -> None:
        """Waits for ``key``: ``SaveCancelled`` as soon as the save is cancelled, ``TimeoutError`` past ``timeout``.

        Polls with ``check`` rather than ``Store.wait`` slices: a TCPStore client logs a warning for every
        ``wait`` that times out, which would be ten lines a second on the console.
        """
        assert self._store is not None
        deadline = time.monotonic() + timeout
        delay = 0.005
        skipped = key.rsplit("/", 1)[0] + "/skipped"
        while not self._store.check([key]):
            if self.is_cancelled():
                raise SaveCancelled(f"cancelled while waiting for {what()} (a rank was lost: the generation moved)")
            if self._store.check([skipped]):
                raise SaveCancelled(f"given up while waiting for {what()}: rank {self._store.get(skipped).decode()} "
                                    "skipped the step (its previous save was still in flight)")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what()}")
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, POLL_S)

    def _key(self, step: int, name: str) -> str:
        return f"{self._prefix}/{step}/{name}"

    def tagged(self, tag: str | None) -> StoreCoordinator:
        """This coordinator for saves tagged ``tag`` (keys under ``{prefix}/{tag}/{step}/``); itself for None."""
        if tag is None:
            return self
        if not tag or "/" in tag:
            raise ValueError(f"a save's tag must be a non-empty name without '/', got {tag!r}")
        return StoreCoordinator(self._store, rank=self._rank, world_size=self._world, prefix=f"{self._prefix}/{tag}",
                                cancelled=self._cancelled)

    def skip(self, step: int) -> None:
        """This rank will not save ``step``: every rank waiting on it gives the step up."""
        if self._store is not None:
            self._store.set(self._key(step, "skipped"), str(self._rank))

    def unskip(self, step: int) -> None:
        """This rank saves ``step`` after all (it skipped it before): its marker goes."""
        key = self._key(step, "skipped")
        if self._store is not None and self._store.check([key]) and self._store.get(key).decode() == str(self._rank):
            self._store.delete_key(key)

    def report(self, step: int, report: Report) -> None:
        if self._store is None:
            self._local[step] = report
            return
        self._store.set(self._key(step, f"rank/{self._rank}"), json.dumps(report))
        if self._store.add(self._key(step, "arrived"), 1) == self._world:
            self._store.set(self._key(step, "all"), "1")

    def gather(self, step: int, timeout: float) -> dict[int, Report]:
        """Rank 0: every rank's report; ``TimeoutError`` when some rank never reported."""
        if self._store is None:
            return {0: self._local.pop(step)}

        def what() -> str:
            arrived = self._store.add(self._key(step, "arrived"), 0)  # type: ignore[union-attr]
            return f"every rank to finish writing step {step} ({arrived} of {self._world} did)"

        self._wait(self._key(step, "all"), timeout, what)
        return {r: json.loads(self._store.get(self._key(step, f"rank/{r}"))) for r in range(self._world)}

    def announce(self, step: int, *, ok: bool, reason: str | None = None, storage: str | None = None) -> None:
        if self._store is None:
            return
        self._store.set(self._key(step, "outcome"), json.dumps({"ok": ok, "reason": reason, "storage": storage}))

    def outcome(self, step: int, timeout: float) -> dict[str, Any]:
        """Other ranks: rank 0's verdict on the step; ``TimeoutError`` when none came."""
        if self._store is None:
            return {"ok": True, "reason": None}
        self._wait(self._key(step, "outcome"), timeout, lambda: f"rank 0's commit verdict on step {step}")
        return json.loads(self._store.get(self._key(step, "outcome")))


def _own_connection(store: dist.Store | None) -> dist.Store | None:
    if store is None:
        return None
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError, AttributeError):  # stores without clone (HashStore, FileStore)
        return store
