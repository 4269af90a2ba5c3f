"""A store connection that ends every call by a deadline and follows the store when it moves.

c10d's TCPStore client bounds only ``get`` and ``wait``: ``set``, ``add``,
``check`` and ``compare_set`` block for as long as the host neither answers
nor closes the connection (a stopped agent, a cut link). A
:class:`MovableStore` makes each call on one helper thread per connection
and waits for it in slices: past its deadline, or as soon as the shared
:class:`~resilient_train.protocol.succession.location.StoreLocation` moved, the call
raises :class:`~resilient_train.protocol.succession.location.StoreLost` (a
``DistNetworkError``, as a reset connection's). A connection that failed
stays failed (its helper may still be blocked in the call) until the
location moves; the next call then connects to the new endpoint.

It is a ``torch.distributed.Store``: process groups and ``PrefixStore`` take
it. ``clone()`` opens a connection of its own on the same location (a
blocking wait does not hold the others up); ``scoped(prefix)`` is a view
with a key prefix on the same connection, with a working ``clone`` (a
``PrefixStore`` over a Python store has none).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from resilient_train.protocol.succession.location import StoreLocation, StoreLost

__all__ = ["MovableStore"]

_SLICE_S = 0.2  # a waiting call looks at the location this often


@dataclass
class _Call:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class _Conn:
    """One client connection of one epoch, and the thread that makes its calls; it connects on that thread
    too (a stopped host takes the connection into its backlog and never answers the client's handshake)."""

    def __init__(self, connect: Callable[[], dist.Store], epoch: int) -> None:
        self._connect, self.epoch = connect, epoch
        self.store: dist.Store | None = None
        self.dead: str | None = None
        self._calls: queue.Queue[_Call | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=f"rt-store-e{epoch}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> _Call:
        call = _Call(fn)
        self._calls.put(call)
        return call

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            try:
                if self.store is None:
                    self.store = self._connect()
                call.result = call.fn()
            except BaseException as e:  # noqa: BLE001  (handed to the caller)
                call.error = e
            call.done.set()

    def close(self) -> None:
        self._calls.put(None)  # a thread blocked in a call past its deadline stays, a daemon


class _Holder:
    """The connection a store and its scoped views share."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conn: _Conn | None = None

    def __del__(self) -> None:
        if self.conn is not None:
            self.conn.close()


class MovableStore(dist.Store):
    def __init__(self, location: StoreLocation, *, prefix: str = "", _holder: _Holder | None = None) -> None:
        super().__init__()
        self.location = location
        self._prefix = prefix
        self._holder = _holder if _holder is not None else _Holder()
        self._timeout: timedelta = location.timeout
        self.calls = 0  # calls submitted so far (a test waits for one to be under way)

    # ------------------------------------------------------------ views
    def clone(self) -> "MovableStore":
        return MovableStore(self.location, prefix=self._prefix)

    def scoped(self, prefix: str) -> "MovableStore":
        """Keys under ``prefix/`` (as ``PrefixStore(prefix, self)`` names them), on this connection."""
        return MovableStore(self.location, prefix=f"{self._prefix}{prefix}/", _holder=self._holder)

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    # -------------------------------------------------------- the calls
    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", lambda s: s.set(self._k(key), value))

    def get(self, key: str) -> bytes:
        return self._call(f"get of {key}", lambda s: s.get(self._k(key)), blocking_s=self._timeout.total_seconds())

    def add(self, key: str, amount: int) -> int:
        return self._call("add", lambda s: s.add(self._k(key), amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call("compare_set", lambda s: s.compare_set(self._k(key), expected, desired))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", lambda s: s.check([self._k(k) for k in keys]))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        t = self._timeout if timeout is None else timeout
        self._call(f"wait for {keys[0] if keys else ''}", lambda s: s.wait([self._k(k) for k in keys], t),
                   blocking_s=t.total_seconds())

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", lambda s: s.delete_key(self._k(key)))

    def num_keys(self) -> int:
        return self._call("num_keys", lambda s: s.num_keys())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", lambda s: s.multi_get([self._k(k) for k in keys]),
                          blocking_s=self._timeout.total_seconds())

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._call("multi_set", lambda s: s.multi_set([self._k(k) for k in keys], values))

    def append(self, key: str, value: str | bytes) -> None:
        self._call("append", lambda s: s.append(self._k(key), value))

    # ----------------------------------------------------------- inside
    def _k(self, key: str) -> str:
        return self._prefix + key

    def _connection(self) -> _Conn:
        endpoint = self.location.endpoint
        with self._holder.lock:
            conn = self._holder.conn
            if conn is None or conn.epoch != endpoint.epoch:
                if conn is not None:
                    conn.close()
                self._holder.conn = None
                conn = self._holder.conn = _Conn(lambda: self.location.connect(endpoint), endpoint.epoch)
            if conn.dead is not None:
                raise StoreLost(conn.dead)
            return conn

    def _call(self, name: str, fn: Callable[[dist.Store], Any], *, blocking_s: float = 0.0) -> Any:
        conn = self._connection()
        timeout = self._timeout
        call = conn.submit(lambda: _timed(conn.store, timeout, fn) if blocking_s else fn(conn.store))  # type: ignore[arg-type]
        self.calls += 1
        # A first call connects too: TCPStore's connect retries until its timeout (call_timeout_s), twice.
        deadline = time.monotonic() + blocking_s + self.location.call_timeout_s * (1 if conn.store else 3)
        while not call.done.wait(_SLICE_S):
            if self.location.epoch != conn.epoch:
                conn.dead = f"the store moved to {self.location.endpoint} during a {name}"
                raise StoreLost(conn.dead)
            if time.monotonic() >= deadline:
                conn.dead = (f"the store did not answer a {name} within "
                             f"{blocking_s + self.location.call_timeout_s:g} s")
                raise StoreLost(conn.dead)
        if call.error is None:
            return call.result
        if isinstance(call.error, (dist.DistNetworkError, StoreLost)):
            conn.dead = str(call.error).splitlines()[0][:200] or type(call.error).__name__
            raise StoreLost(conn.dead) from None
        raise call.error


def _timed(store: dist.Store, timeout: timedelta, fn: Callable[[dist.Store], Any]) -> Any:
    """A blocking read with this view's timeout (views share a connection, each with its own timeout)."""
    store.set_timeout(timeout)
    return fn(store)
