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
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from resilient_train.store import Keys

__all__ = ["abort_nccl", "build_group", "destroy_group", "join_releases", "release_in_background"]

_releases: list[threading.Thread] = []


def _reset_counter() -> None:
    c10d._world.group_count = 0


def build_group(store: dist.Store, generation: int, *, rank: int, world_size: int, backend: str,
                timeout_s: float, device: torch.device) -> dist.ProcessGroup:
    if dist.is_initialized():
        release_in_background([g] if (g := destroy_group(device)) is not None else [])
    _reset_counter()
    kwargs = {"device_id": device} if device.type == "cuda" else {}
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
