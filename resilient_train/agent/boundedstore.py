"""Every store call of a node agent that does not host the store ends by a deadline.

c10d's TCPStore client bounds only ``get`` and ``wait`` (``set_timeout``):
``add``, ``check``, ``set`` and ``compare_set`` block in ``recv`` for as long
as the server neither answers nor closes the connection. A node 0 whose host
vanishes without a reset, or whose agent is stopped (SIGSTOP, a debugger: the
store lives in that process), would hang every other agent there, its ranks
with it. So the agents of nodes other than 0 make their calls through
:class:`BoundedStore`: each call runs on one helper thread, and a call that
has not returned within the deadline raises :class:`StoreDeadline` (a
``DistStoreError``, which the agent takes as "the store is lost"); so does
every later call, at once (the helper thread may still be blocked in the
first: it is a daemon, left to the process's exit). One thread hop per call,
and the agent makes a few calls a second.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["BoundedStore", "StoreDeadline", "call_timeout_s"]

MIN_CALL_TIMEOUT_S = 5.0  # a loaded store host answers in milliseconds; seconds without a word is a lost host


def call_timeout_s(node_timeout_s: float) -> float:
    """The deadline of one call: as long as a node may stay silent before it counts as lost, 5 s at least."""
    return max(node_timeout_s, MIN_CALL_TIMEOUT_S)


class StoreDeadline(dist.DistStoreError):
    """A store call ran past its deadline: the store's host stopped answering."""


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class BoundedStore:
    """``store``'s methods, each bounded by ``timeout_s`` (attributes that are not methods pass through)."""

    def __init__(self, store: dist.Store, *, timeout_s: float, name: str = "agent") -> None:
        self._store, self._timeout_s = store, timeout_s
        self._calls: queue.Queue[_Call | None] = queue.Queue()
        self._lost: str | None = None
        self._thread = threading.Thread(target=self._serve, name=f"rt-store-{name}", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> str | None:
        """Why the store counts as lost (a call past its deadline), else None."""
        return self._lost

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, attr, args, kwargs)

        return call

    def _call(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._lost is not None:
            raise StoreDeadline(self._lost)
        call = _Call(fn, args, kwargs)
        self._calls.put(call)
        if not call.done.wait(self._timeout_s):
            self._lost = f"the store did not answer a {name} within {self._timeout_s:g} s"
            raise StoreDeadline(self._lost)
        if call.error is not None:
            raise call.error
        return call.result

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            try:
                call.result = call.fn(*call.args, **call.kwargs)
            except BaseException as e:  # noqa: BLE001  (handed to the caller, raised there)
                call.error = e
            call.done.set()

    def close(self) -> None:
        """Ends the helper thread (one blocked in a call past its deadline stays, a daemon)."""
        self._calls.put(None)
        self._thread.join(timeout=1.0)
