"""The coordination store: key names, the job's namespace, and waits with deadlines.

Every key of the runtime lives under ``rt/`` and, where it belongs to one
generation, carries that generation in its name, so nothing a finished
generation left behind is ever read by the next one.

The keys of a job live under a namespace derived from the job's secret token
(``RT_JOB_TOKEN``, made by the agent and handed to its ranks in their
environment, which only the job's own user can read): a process that reaches
the store's port but not the token writes keys that nobody reads, so it can
neither end nor fail the job (docs/security.md).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from resilient_train.protocol import env as E
from resilient_train.protocol.env import WorkerEnv
from resilient_train.protocol.succession.location import Endpoint, StoreLocation
from resilient_train.protocol.succession.movable import MovableStore

__all__ = [
    "Keys", "StoreTimeout", "attempt_store", "connect_worker_store", "current_generation", "declare_fault",
    "fail_join", "interrupt_for_stop", "interrupt_generation", "job_store", "new_token", "read_fault", "read_stop",
    "report_fault", "request_stop", "scoped", "settle", "wait_until",
]


class StoreTimeout(TimeoutError):
    """A wait on the store ran past its deadline."""


class Keys:
    """Named key templates."""

    GENERATION = "rt/generation"
    FINAL = "rt/final"  # set once the final state is committed
    STOP = "rt/stop"  # set when a rank stops the job (a bug, a misuse): JSON with the reason and exit code

    @staticmethod
    def fault(g: int) -> str:
        return f"rt/fault/{g}"

    @staticmethod
    def member(g: int, rank: int) -> str:
        return f"rt/gen/{g}/member/{rank}"

    @staticmethod
    def pg_prefix(g: int) -> str:
        return f"rt/gen/{g}/pg"

    @staticmethod
    def settled(g: int) -> str:
        """The outcome of generation ``g``'s join: its plan (JSON, written once by its last joiner) or FAILED."""
        return f"rt/gen/{g}/settled"

    @staticmethod
    def wake(g: int, rank: int) -> str:
        """Set when ``rank``'s watcher of generation ``g`` must look (see :func:`interrupt_generation`): the
        watcher only waits for the key (one round trip), so its value says nothing."""
        return f"rt/gen/{g}/wake/{rank}"

    WOKEN = "woken"

    FAILED = "failed"  # Keys.settled(g) when g failed before its plan was written

    @staticmethod
    def outcome(g: int) -> str:
        """``settled(g)``'s value, written with a ``set`` once it is decided: what the joiners read (see :func:`settle`)."""
        return f"rt/gen/{g}/outcome"

    @staticmethod
    def done(g: int) -> str:
        return f"rt/gen/{g}/done"

    @staticmethod
    def restored(g: int) -> str:
        """A counter: the ranks of generation ``g`` whose state stands at its resume step (an elastic job's
        node that joins late waits for all of them before it fails ``g``: resilient_train.agent.width)."""
        return f"rt/gen/{g}/restored"

    @staticmethod
    def gen_scope(g: int, name: str) -> str:
        """A key of generation ``g`` for one of the runtime's parts (checkpoints, rerun)."""
        return f"rt/gen/{g}/{name}"

    @staticmethod
    def supervised(rank: int) -> str:
        return f"rt/supervised/{rank}"

    @staticmethod
    def chaos_fired(index: int) -> str:
        return f"rt/chaos/fired/{index}"


def new_token() -> str:
    return secrets.token_hex(16)


def job_store(store: dist.Store, token: str) -> dist.Store:
    """The job's namespace on ``store``: keys written without ``token`` never land in it."""
    return dist.PrefixStore(f"job-{token}", store)


def scoped(store: dist.Store, prefix: str) -> dist.Store:
    """``PrefixStore(prefix, store)``, but a store that moves stays one (a view of its own, with a ``clone``)."""
    return store.scoped(prefix) if isinstance(store, MovableStore) else dist.PrefixStore(prefix, store)


def attempt_store(store: dist.Store, attempt: int) -> dist.Store:
    """The keys of one launcher attempt (torchrun's restart count)."""
    return dist.PrefixStore(f"attempt/{attempt}", store)


def connect_worker_store(env: WorkerEnv, *, timeout: timedelta) -> dist.Store:
    """The store a worker coordinates through, wherever it was launched."""
    token = os.environ.get(E.RT_JOB_TOKEN) or os.environ.get(E.TORCHELASTIC_RUN_ID, "none")
    attempt = int(os.environ.get(E.TORCHELASTIC_RESTART_COUNT, "0"))
    if env.under_agent and os.environ.get(E.RT_STORE_FILE):
        # Many nodes: the store may move to a successor (resilient_train.protocol.succession); every call ends by a
        # deadline, and every connection follows a move this rank's agent announces (resilient_train.rank.storefollow).
        location = StoreLocation(
            Endpoint(env.master_addr, env.master_port, int(os.environ.get(E.RT_STORE_EPOCH, "0"))),
            wrap=lambda raw: attempt_store(job_store(raw, token), attempt), timeout=timeout,
            call_timeout_s=float(os.environ.get(E.RT_STORE_CALL_S, "5")))
        return MovableStore(location)
    if env.under_agent or os.environ.get(E.TORCHELASTIC_USE_AGENT_STORE) == "True":
        store = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)
    elif E.MASTER_PORT not in os.environ:
        # Alone, with no launcher: an in-process store on loopback.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    else:
        # Plain torchrun with its own store disabled: rank 0 hosts, as env:// would.
        store = dist.TCPStore(
            env.master_addr, env.master_port, world_size=env.world_size, is_master=env.rank == 0,
            timeout=timeout, wait_for_workers=False,
        )
    # A launcher that restarts every worker (torchrun) may keep its store: each attempt gets its own keys.
    return attempt_store(job_store(store, token), attempt)


def current_generation(store: dist.Store) -> int:
    # One request: creates the key as "0" when it is missing, else returns what it holds.
    return int(store.compare_set(Keys.GENERATION, "", "0"))


def declare_fault(store: dist.Store, generation: int, cause: dict[str, Any], *, world_size: int) -> bool:
    """Marks ``generation`` as failed and moves the run to the next one.

    The agent (a worker died) and the ranks (a step raised) do the same thing,
    so a run under plain torchrun recovers with the same protocol. Idempotent:
    the first cause is kept and the generation moves only once. Returns whether
    this call was the first to report the fault.
    """
    return report_fault(store, generation, cause, world_size=world_size)[0]


def report_fault(store: dist.Store, generation: int, cause: dict[str, Any], *,
                 world_size: int) -> tuple[bool, dict[str, Any]]:
    """:func:`declare_fault`, and the cause that stands (the first report's), read in the same request.

    The first reporter moves the generation, settles its join as FAILED and
    wakes every rank's watcher (one ``multi_set`` of ``world_size`` keys). A
    later reporter moves the generation too (idempotent) and wakes the
    watchers only if the first did not get that far (it died in between).
    """
    payload = json.dumps(cause, default=str)
    standing = store.compare_set(Keys.fault(generation), "", payload).decode()
    first = standing == payload
    store.compare_set(Keys.GENERATION, str(generation), str(generation + 1))
    if first or not store.check([Keys.wake(generation, world_size - 1)]):
        interrupt_generation(store, generation, world_size=world_size)
    if first and (store.check([Keys.FINAL]) or store.check([Keys.STOP])):
        # The run finished or was stopped as it failed: rank 0 (or the stopper) settles the generation it
        # read after writing FINAL (or STOP), which may be the one before this move. Woken ranks join
        # generation + 1 without looking: it must not wait for ranks that have left.
        fail_join(store, generation + 1, world_size=world_size)
    return first, json.loads(standing)


def settle(store: dist.Store, generation: int, value: str) -> str:
    """``generation``'s join ends with ``value`` (its plan, or FAILED) unless it already ended; returns the
    value that stands.

    The value is a ``compare_set`` (the first wins, for everyone); the joiners
    read it from :meth:`Keys.outcome`, written with a ``set`` by whoever
    settles (the same value, whoever wins), because the store the agent hosts
    (TCPStore without libuv, to take a listening socket) answers a ``wait``
    (and so a ``get``) on a ``set``, ``add`` or ``multi_set``, never on a ``compare_set``.
    """
    standing = store.compare_set(Keys.settled(generation), "", value)
    store.set(Keys.outcome(generation), standing)
    return standing.decode()


def fail_join(store: dist.Store, generation: int, *, world_size: int) -> None:
    """``generation``'s join ends as FAILED unless it was planned; its planner's wait for memberships ends too
    (those still missing read FAILED)."""
    if settle(store, generation, Keys.FAILED) == Keys.FAILED:
        store.multi_set([Keys.member(generation, r) for r in range(world_size)], [Keys.FAILED] * world_size)


def interrupt_generation(store: dist.Store, generation: int, *, world_size: int) -> None:
    """Ends every wait on ``generation``: its join (settled as FAILED unless planned) and its ranks' watchers.

    A woken rank joins ``generation + 1`` without asking why (its watcher only waits for the key): after a
    fault that is the run's next generation; whoever interrupts for another reason (a stop) first fails that
    join (:func:`interrupt_for_stop`), so the rank finds out there.
    """
    fail_join(store, generation, world_size=world_size)
    store.multi_set([Keys.wake(generation, r) for r in range(world_size)], [Keys.WOKEN] * world_size)


def interrupt_for_stop(store: dist.Store, *, world_size: int) -> None:
    """The job was stopped (``request_stop``): every watcher and join of the current generation looks now.

    Woken ranks join the next generation without asking why: its join fails first, so they find the stop there.
    """
    g = current_generation(store)
    fail_join(store, g + 1, world_size=world_size)
    interrupt_generation(store, g, world_size=world_size)


def read_fault(store: dist.Store, generation: int) -> dict[str, Any] | None:
    key = Keys.fault(generation)
    if not store.check([key]):
        return None
    return json.loads(store.get(key))


def request_stop(store: dist.Store, reason: dict[str, Any]) -> dict[str, Any]:
    """Stops the job (first reason wins); returns the reason that stands."""
    payload = json.dumps(reason, default=str)
    return json.loads(store.compare_set(Keys.STOP, "", payload))


def read_stop(store: dist.Store) -> dict[str, Any] | None:
    if not store.check([Keys.STOP]):
        return None
    return json.loads(store.get(Keys.STOP))


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
