"""Completion of a save across ranks, agreed through a c10d Store (not a process group).

The runtime may tear down its process groups after a fault while a save is in
flight, and the store (hosted by the agent) outlives any rank. Keys, under
``{prefix}/{step}/``: ``rank/{r}`` each rank's report (its files, or its error),
``arrived`` a counter, ``all`` set by the last rank to arrive, ``outcome`` set by
rank 0 once it committed or gave up. Pass a store namespaced by generation
(e.g. a ``PrefixStore``) so a step saved again after a restart starts clean.

The committer blocks in ``Store.wait``; a TCPStore client serves one request at
a time, so the coordinator works on its own connection (``Store.clone()``) and
never stalls the caller's heartbeats or rendezvous on the shared one.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Report", "StoreCoordinator"]

Report = dict[str, Any]  # {"files": {...}, "local_tree": {...}} or {"error": "..."}


class StoreCoordinator:
    def __init__(self, store: dist.Store | None, *, rank: int, world_size: int, prefix: str) -> None:
        if store is None and world_size > 1:
            raise ValueError("CheckpointManager: world_size > 1 needs a store to coordinate commits")
        self._store = _own_connection(store)
        self._rank = rank
        self._world = world_size
        self._prefix = prefix
        self._local: dict[int, Report] = {}
        self._outcome: dict[int, dict[str, Any]] = {}

    def set_store(self, store: dist.Store) -> None:
        self._store = _own_connection(store)

    def _key(self, step: int, name: str) -> str:
        return f"{self._prefix}/{step}/{name}"

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
        try:
            self._store.wait([self._key(step, "all")], timedelta(seconds=timeout))
        except dist.DistStoreError as e:
            arrived = self._store.add(self._key(step, "arrived"), 0)
            raise TimeoutError(f"only {arrived} of {self._world} ranks finished writing step {step}: {e}") from None
        return {r: json.loads(self._store.get(self._key(step, f"rank/{r}"))) for r in range(self._world)}

    def announce(self, step: int, *, ok: bool, reason: str | None = None) -> None:
        if self._store is None:
            return
        self._store.set(self._key(step, "outcome"), json.dumps({"ok": ok, "reason": reason}))

    def outcome(self, step: int, timeout: float) -> dict[str, Any]:
        """Other ranks: rank 0's verdict on the step; ``TimeoutError`` when none came."""
        if self._store is None:
            return {"ok": True, "reason": None}
        try:
            self._store.wait([self._key(step, "outcome")], timedelta(seconds=timeout))
        except dist.DistStoreError as e:
            raise TimeoutError(f"no commit verdict for step {step} from rank 0: {e}") from None
        return json.loads(self._store.get(self._key(step, "outcome")))


def _own_connection(store: dist.Store | None) -> dist.Store | None:
    if store is None:
        return None
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError, AttributeError):  # stores without clone (HashStore, FileStore)
        return store
