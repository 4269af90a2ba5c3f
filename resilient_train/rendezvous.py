"""A rank's side of a generation change, as the supervisor drives it: report the fault, then enter the next generation.

These are the store calls of the supervisor's ``_recover`` and ``_join``, in
one place, so that ``bench/coordination.py`` drives the same code with
thousands of simulated ranks that the supervisor drives with real ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from resilient_train.generation import Membership, ResumePlan, RunFinished, join_generation
from resilient_train.store import Keys, current_generation, interrupt_generation, report_fault

if TYPE_CHECKING:
    from resilient_train.watch import GenerationWatcher

__all__ = ["enter_generation", "interrupt_for_stop", "leave_generation", "report_fault"]


def leave_generation(store: dist.Store, generation: int, cause: dict[str, Any], *, world_size: int,
                     watcher: "GenerationWatcher") -> tuple[bool, dict[str, Any] | None, int | None]:
    """A rank's side of a fault: ``(first reporter, the cause that stands, the generation to join)``.

    A rank whose watcher was woken by a fault that moved the run on asks the
    store nothing: the fault is recorded, every rank is woken, and the wake
    named the next generation (its plan will carry the cause: ``(False, None,
    that generation)``). Any other rank reports (it may be the first); it then
    joins whatever generation the store holds (``None``).
    """
    moved_to = watcher.next_generation if watcher.moved.is_set() else None
    if generation < 0 or moved_to is not None:
        return False, None, moved_to
    first, standing = report_fault(store, generation, cause, world_size=world_size, woken=watcher.moved.is_set())
    return first, standing, None


def enter_generation(store: dist.Store, *, world_size: int, me: Callable[[], Membership], timeout: float,
                     stopped: Callable[[], None], moved_to: int | None = None) -> ResumePlan:
    """Joins the current generation and returns its plan; :class:`RunFinished` once the run's final state is in.

    ``moved_to``: the generation this rank's wake named (a fault moved the run there). The rank joins it
    straight away: a run that finished or stopped meanwhile settles it as FAILED, and the join looks then.
    """
    if moved_to is None and store.check([Keys.FINAL]):
        raise RunFinished()
    return join_generation(store, world_size=world_size, me=me, timeout=timeout,
                           finished=lambda: store.check([Keys.FINAL]), stopped=stopped, generation=moved_to)


def interrupt_for_stop(store: dist.Store, *, world_size: int) -> None:
    """The job was stopped (``request_stop``): every watcher and join of the current generation looks now."""
    interrupt_generation(store, current_generation(store), world_size=world_size)
