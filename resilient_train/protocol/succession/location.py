"""Where the job's store is now: an endpoint and its epoch, shared by every store connection of a process.

The epoch counts the store's moves (0: node 0's agent's store, 1: the first
successor's, ...). Every :class:`~resilient_train.protocol.succession.movable.MovableStore`
of a process reads the same :class:`StoreLocation`: when it moves, each of
them reconnects at its next call, and a call still waiting on the old host
ends at once.

An agent tells its ranks where the store went in a small file of its own
(:func:`announce`, atomically replaced; its path is in the ranks'
environment, ``RT_STORE_FILE``): a rank follows its own agent, which moved
only with a majority (resilient_train.protocol.succession.rules), and never looks
for a store by itself.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist

__all__ = ["MIN_CALL_TIMEOUT_S", "Endpoint", "StoreLocation", "StoreLost", "announce", "announced", "call_timeout_s", "read_announcement"]


MIN_CALL_TIMEOUT_S = 5.0  # a loaded store host answers in milliseconds; seconds without a word is a lost host


def call_timeout_s(node_timeout_s: float) -> float:
    """The deadline of one store call of an agent or rank of a many-node job: as long as a node may stay silent
    before it counts as lost, 5 s at least (c10d's TCPStore client bounds only ``get`` and ``wait``: ``set``,
    ``add``, ``check`` and ``compare_set`` block for as long as a stopped host keeps the connection open)."""
    return max(node_timeout_s, MIN_CALL_TIMEOUT_S)


class StoreLost(dist.DistNetworkError):
    """The store's host went: a connection reset, a call past its deadline, or the store moved under the call."""


@dataclass(frozen=True)
class Endpoint:
    addr: str
    port: int
    epoch: int = 0

    def __str__(self) -> str:
        return f"{self.addr}:{self.port}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: str | bytes) -> "Endpoint":
        d = json.loads(data)
        return cls(addr=str(d["addr"]), port=int(d["port"]), epoch=int(d["epoch"]))


class StoreLocation:
    """The current endpoint; ``wrap`` turns a raw client into the job's view of it (its namespace, its attempt).

    ``timeout``: a client's blocking reads (``get``, ``wait``), as TCPStore's own; ``call_timeout_s``: every
    other call's deadline (a host that stops answering without closing the connection: SIGSTOP, a cut link).
    """

    def __init__(self, endpoint: Endpoint, *, wrap: Callable[[dist.Store], dist.Store], timeout: timedelta,
                 call_timeout_s: float) -> None:
        self._endpoint = endpoint
        self.wrap = wrap
        self.timeout = timeout
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self.moved = threading.Condition(self._lock)

    @property
    def endpoint(self) -> Endpoint:
        with self._lock:
            return self._endpoint

    @property
    def epoch(self) -> int:
        return self.endpoint.epoch

    def move(self, endpoint: Endpoint) -> bool:
        """The store is at ``endpoint`` now: every connection follows at its next call. An endpoint of an epoch
        no later than the current one changes nothing (False): a rank's two threads may follow one announcement
        (resilient_train.rank.storefollow)."""
        with self._lock:
            if endpoint.epoch <= self._endpoint.epoch:
                return False
            self._endpoint = endpoint
            self.moved.notify_all()
            return True

    def connect(self, endpoint: Endpoint) -> dist.Store:
        """A client of ``endpoint``, in the job's view; raises :class:`StoreLost` when it cannot be reached."""
        try:
            raw = dist.TCPStore(endpoint.addr, endpoint.port, is_master=False,
                                timeout=timedelta(seconds=self.call_timeout_s))
        except (RuntimeError, OSError) as e:
            raise StoreLost(f"cannot reach the store at {endpoint}: {str(e).splitlines()[0][:200]}") from None
        raw.set_timeout(self.timeout)
        return self.wrap(raw)


def announce(path: Path, endpoint: Endpoint) -> None:
    """Tells this agent's ranks where the store is now (written whole, then renamed over the last one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(endpoint.to_json())
    os.replace(tmp, path)


def read_announcement(path: Path) -> Endpoint | None:
    """The endpoint an agent announced in ``path``, or None (none yet, or not one)."""
    try:
        return Endpoint.from_json(path.read_text())
    except (OSError, ValueError, KeyError):
        return None


def announced(path: Path | None, *, after: int, timeout_s: float, interval_s: float = 0.05) -> Endpoint | None:
    """The endpoint this process's agent announced with an epoch past ``after``, waiting up to ``timeout_s``;
    None when none came (the agent did not move: it was fenced, or stopped)."""
    if path is None:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        endpoint = read_announcement(path)
        if endpoint is not None and endpoint.epoch > after:
            return endpoint
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)
