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

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from resilient_train.store import Keys

__all__ = ["abort_nccl", "build_group", "destroy_group"]


def _reset_counter() -> None:
    c10d._world.group_count = 0


def build_group(store: dist.Store, generation: int, *, rank: int, world_size: int, backend: str,
                timeout_s: float, device: torch.device) -> dist.ProcessGroup:
    if dist.is_initialized():
        destroy_group(device)
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


def destroy_group(device: torch.device) -> None:
    """Tears the default group down (aborting NCCL first); a broken group has nothing left to release."""
    if dist.is_initialized():
        try:
            if device.type == "cuda":
                abort_nccl()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    _reset_counter()


def abort_nccl() -> None:
    """Aborts the NCCL communicators, from any thread: a rank blocked in a collective is released."""
    if dist.is_initialized():
        c10d._abort_process_group()
