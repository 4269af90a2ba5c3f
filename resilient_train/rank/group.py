"""Each generation's process group: built on the generation's own keys, torn down leaving nothing behind.

Two things of torch's are process-global and outlive a group, so they are put
back here (the only place this package touches torch's private state):

* the group counter names the default group's keys in the store; a failed
  ``init_process_group`` advances it and nothing resets it, so a survivor and
  a fresh replacement would name the next group differently and never meet
  (the livelock of issue 17). It is reset before every build and after a
  failed one.
* every ``init_process_group`` wraps ``sys.excepthook`` to prefix
  ``[rankN]:``, once more each generation; the hook is put back.
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from resilient_train.rank.cancelstore import CancellableStore
from resilient_train.protocol.store import Keys

__all__ = ["abort_nccl", "backend_device", "build_group", "destroy_group", "join_releases", "release_group", "release_in_background",
           "release_retired"]

_releases: list[threading.Thread] = []


def backend_device(backend: str, local_rank: int) -> tuple[str, torch.device]:
    """The backend (``auto``: NCCL with CUDA, else gloo) and this rank's device (CUDA's current one set)."""
    backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return backend, torch.device("cuda", local_rank)
    return backend, torch.device("cpu")


def _reset_counter() -> None:
    c10d._world.group_count = 0


def build_group(store: dist.Store, generation: int, *, rank: int, world_size: int, backend: str,
                timeout_s: float, device: torch.device,
                cancelled: threading.Event | None = None) -> dist.ProcessGroup:
    """The default group of ``generation``; on gloo, its build fails once ``cancelled`` is set (the watcher's
    ``moved``) instead of waiting ``timeout_s`` for a rank lost before it published its address."""
    if dist.is_initialized():
        release_in_background([g] if (g := destroy_group(device)) is not None else [])
    _reset_counter()
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if backend == "gloo" and cancelled is not None:
        store = CancellableStore(store, cancelled, what=f"building generation {generation}'s group")
    hook = sys.excepthook
    try:
        dist.init_process_group(
            backend, store=dist.PrefixStore(Keys.pg_prefix(generation), store), rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s), **kwargs,
        )
    except BaseException:
        _reset_counter()
        raise
    finally:
        sys.excepthook = hook
    group = dist.group.WORLD
    assert group is not None
    return group


def destroy_group(device: torch.device) -> dist.ProcessGroup | None:
    """Unregisters the default group (aborting NCCL first) and returns it, or None if there was none.

    The caller drops the returned object with :func:`release_in_background`: the
    group's destructor joins gloo's worker threads, and one of them may sit in a
    collective that only its timeout ends (gloo cannot abort one).
    """
    group = dist.group.WORLD if dist.is_initialized() else None
    if group is not None:
        try:
            if device.type == "cuda":
                abort_nccl()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (a broken group has nothing left to release)
            pass
    _reset_counter()
    return group


RELEASE_AT_EXIT_S = 5.0  # how long an exiting process waits for groups still being released


def release_in_background(box: list[dist.ProcessGroup]) -> None:
    """Drops the last reference to a destroyed group on a daemon thread.

    ``box`` holds the only reference the caller has; it is emptied on that thread, so
    the destructor, with its wait for a collective still in flight, blocks nobody.
    At exit the process waits a little for these threads: a destructor cut short by
    the interpreter's exit aborts the process ("terminate called ...").
    """
    def drop() -> None:
        box.clear()

    thread = threading.Thread(target=drop, name="rt-release-group", daemon=True)
    thread.start()
    _releases[:] = [t for t in _releases if t.is_alive()] + [thread]


def release_group(device: torch.device, *, retire: bool, retired: list[list[dist.ProcessGroup]],
                  held: Callable[[list[str]], None]) -> None:
    """Destroys the default group once the caller dropped its own references to it (a failed one, or at exit).

    A gloo group closes its connections only when its last reference goes:
    while a DDP, a pending reduction or a frame holds it, peers blocked in a
    collective with this rank wait for the full group timeout instead of
    failing at once. The last reference is dropped on a daemon thread: the
    destructor waits for gloo's worker threads, and one may sit in a
    collective that only the timeout ends (seen at 4 ranks: 30 s).

    ``held`` is told the holders' types when something else still holds the group; then, with ``retire``
    (the rank is recovering), its box goes to ``retired`` until :func:`release_retired`.
    """
    box = [g] if (g := destroy_group(device)) is not None else []
    del g
    gc.collect()
    if box and sys.getrefcount(box[0]) > 2:  # the box and getrefcount's own argument
        # Something else holds the group (a DDP built by the script, a frame): its connections stay
        # open, and peers blocked in a collective with this rank wait for the group's timeout.
        held(sorted({type(r).__name__ for r in gc.get_referrers(box[0])} - {"list", "frame"}))
        if retire:
            # The box keeps the group alive until the script's next on_new_group has replaced its DDP.
            # Otherwise the DDP's reducer would hold the last reference, and the script dropping it would
            # run the group's destructor on the main thread with the GIL held: it joins gloo's worker
            # threads, and one still in a collective of the failed step waits for the GIL to run that
            # collective's Python callback: a deadlock (seen at 3 ranks, rank killed at the vote).
            retired.append(box)
            return
    release_in_background(box)


def release_retired(retired: list[list[dist.ProcessGroup]]) -> None:
    """Drops the failed groups held past their generation (:func:`release_group`), on daemon threads."""
    boxes = retired[:]
    retired.clear()
    for box in boxes:
        release_in_background(box)


def join_releases(timeout_s: float) -> None:
    """Waits (at most ``timeout_s`` in all) for the groups being released to be gone.

    The interpreter exiting while a group's destructor runs on its daemon thread
    aborts the process ("terminate called without an active exception"): a run
    that ends gives its releases a moment to finish first (and so does any
    process at exit).
    """
    deadline = time.monotonic() + timeout_s
    for thread in list(_releases):
        thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(join_releases, RELEASE_AT_EXIT_S)


def abort_nccl() -> None:
    """Aborts the NCCL communicators, from any thread: a rank blocked in a collective is released."""
    if dist.is_initialized():
        c10d._abort_process_group()
