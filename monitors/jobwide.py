"""Straggler scores across nodes: every node agent scores its ranks against the job's fastest rank.

Each agent's :class:`~monitors.straggler.StragglerDetector` sees only its own
ranks. At each report it shares one small value through the job's store, its
fastest rank's median work time of the interval and how many ranks it scored,
and reads every node's in one request. The relative score of a rank is then
the job's fastest median over its own, so a node whose ranks are all slow is
found, and a node of one rank is compared with the others.

Traffic: two requests per agent per report interval (a ``set`` and a
``multi_get`` of M small keys), nothing per rank. A node's value older than
``stale_after_s`` (a lost node, a node still starting) does not count.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["JobWide", "JobWideBest"]


@dataclass(frozen=True, kw_only=True)
class JobWide:
    """What the other nodes said at the last exchange."""

    best_s: float | None  # the fastest median work time of any rank in the job (fresh values only)
    ranks: int  # ranks scored across the job
    nodes: int  # nodes whose value was fresh, this one included


class JobWideBest:
    """One node agent's side of the exchange; never raises (a store that does not answer: local scores only)."""

    def __init__(self, store: dist.Store, *, node: int, nnodes: int, stale_after_s: float) -> None:
        self._store = store
        self._node = node
        self._keys = [self.key(n) for n in range(nnodes)]
        self._stale_after_s = stale_after_s
        try:  # present from the start: the others' reads need every node's key
            store.set(self._keys[node], json.dumps({"best_s": None, "ranks": 0, "time": time.time()}))
        except Exception:  # noqa: BLE001
            pass

    @staticmethod
    def key(node: int) -> str:
        return f"rt/straggler/best/{node}"

    def exchange(self, best_s: float | None, ranks: int) -> JobWide | None:
        """Shares this node's fastest median (None: none scored) and reads every node's; None if unreachable."""
        now = time.time()
        try:
            self._store.set(self._keys[self._node], json.dumps({"best_s": best_s, "ranks": ranks, "time": now}))
            if not self._store.check(self._keys):  # a node that never reported: multi_get would wait for it
                return None
            values = self._store.multi_get(self._keys)
        except Exception:  # noqa: BLE001  (the store is down or slow: this interval is scored locally)
            return None
        fresh = [v for v in map(_decode, values) if v is not None and now - v["time"] <= self._stale_after_s]
        bests = [float(v["best_s"]) for v in fresh if v["best_s"] is not None]
        return JobWide(best_s=min(bests) if bests else None, ranks=sum(int(v["ranks"]) for v in fresh),
                       nodes=len(fresh))


def _decode(raw: bytes) -> dict | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) and {"best_s", "ranks", "time"} <= value.keys() else None
