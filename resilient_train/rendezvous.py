"""A rank's side of a generation change, as the supervisor drives it: report the fault, then enter the next generation.

These are the store calls of the supervisor's ``_recover`` and ``_join``, in
one place, so that ``bench/coordination.py`` drives the same code with
thousands of simulated ranks that the supervisor drives with real ones.
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from resilient_train.generation import Membership, ResumePlan, RunFinished, join_generation
from resilient_train.store import Keys, current_generation, interrupt_generation, report_fault

__all__ = ["enter_generation", "interrupt_for_stop", "report_fault"]


def enter_generation(store: dist.Store, *, world_size: int, me: Callable[[], Membership], timeout: float,
                     stopped: Callable[[], None]) -> ResumePlan:
    """Joins the current generation and returns its plan; :class:`RunFinished` once the run's final state is in."""
    if store.check([Keys.FINAL]):
        raise RunFinished()
    return join_generation(store, world_size=world_size, me=me, timeout=timeout,
                           finished=lambda: store.check([Keys.FINAL]), stopped=stopped)


def interrupt_for_stop(store: dist.Store, *, world_size: int) -> None:
    """The job was stopped (``request_stop``): every watcher and join of the current generation looks now."""
    interrupt_generation(store, current_generation(store), world_size=world_size)
