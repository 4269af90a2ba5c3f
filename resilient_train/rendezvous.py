"""A rank's side of a generation change, as the supervisor drives it: report the fault, then enter the next generation.

These are the store calls of the supervisor's ``_recover`` and ``_join``, in
one place, so that ``bench/coordination.py`` drives the same code with
thousands of simulated ranks that the supervisor drives with real ones.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from resilient_train.generation import Membership, ResumePlan, RunFinished, join_generation
from resilient_train.store import Keys, declare_fault, read_fault

__all__ = ["enter_generation", "report_fault"]


def report_fault(store: dist.Store, generation: int, cause: dict[str, Any], *,
                 world_size: int) -> tuple[bool, dict[str, Any] | None]:
    """Declares ``generation`` failed (idempotent); whether this report was the first, and the cause that stands."""
    first = declare_fault(store, generation, cause)
    return first, read_fault(store, generation)


def enter_generation(store: dist.Store, *, world_size: int, me: Callable[[], Membership], timeout: float,
                     stopped: Callable[[], None]) -> ResumePlan:
    """Joins the current generation and returns its plan; :class:`RunFinished` once the run's final state is in."""
    if store.check([Keys.FINAL]):
        raise RunFinished()
    return join_generation(store, world_size=world_size, me=me, timeout=timeout,
                           finished=lambda: store.check([Keys.FINAL]), stopped=stopped)
