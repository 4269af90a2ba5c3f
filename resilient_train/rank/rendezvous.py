"""A rank's side of a generation change, as the supervisor drives it: report the fault, then enter the next generation.

These are the store calls of a recovery (:mod:`resilient_train.rank.recovery`) and the supervisor's ``_join``, in
one place, so that ``bench/coordination.py`` drives the same code with
thousands of simulated ranks that the supervisor drives with real ones.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from resilient_train.rank.fence import check_fence
from resilient_train.rank.generation import RankMembership, ResumePlan, RunFinished, join_generation
from resilient_train.protocol.store import Keys, read_stop, report_fault

if TYPE_CHECKING:
    from resilient_train.rank.watch import GenerationWatcher

__all__ = ["enter_generation", "join_interruptibly", "leave_generation", "report_fault",
           "stop_after_failure"]


def stop_after_failure(store: dist.Store, watcher: "GenerationWatcher") -> dict[str, Any] | None:
    """The job's stop, as a rank whose step failed reads it (None: not stopped, or not asked).

    A rank whose watcher was woken asks nothing: it joins the next generation, whose join a stopper fails
    before it wakes anyone (:func:`interrupt_for_stop`), so the rank reads the stop there. One round trip per
    rank saved at every generation change.
    """
    return None if watcher.moved.is_set() else read_stop(store)


def leave_generation(store: dist.Store, generation: int, cause: dict[str, Any], *, world_size: int,
                     watcher: "GenerationWatcher") -> tuple[bool, dict[str, Any] | None, int | None]:
    """A rank's side of a fault: ``(first reporter, the cause that stands, the generation to join)``.

    A rank whose watcher was woken asks the store nothing: whatever woke it
    (a fault, or a stop) has recorded itself, woken every rank, and left the
    next generation to join (its plan will carry the cause; a stop fails its
    join): ``(False, None, that generation)``. Any other rank reports (it may
    be the first); it then joins whatever generation the store holds (``None``).
    """
    if generation < 0:
        return False, None, None  # it never joined one: nothing to report
    if watcher.moved.is_set():
        return False, None, watcher.next_generation
    first, standing = report_fault(store, generation, cause, world_size=world_size)
    return first, standing, None


def enter_generation(store: dist.Store, *, world_size: int, me: Callable[[], RankMembership], timeout: float,
                     stopped: Callable[[], None], moved_to: int | None = None, elastic: bool = False) -> ResumePlan:
    """Joins the current generation and returns its plan; :class:`RunFinished` once the run's final state is in.

    ``moved_to``: the generation after the one whose wake woke this rank (where a fault moved the run; a
    stop failed its join first). The rank joins it straight away: a run that finished or stopped settles it
    as FAILED, and the join looks then.
    """
    check_fence(store, "join")  # a rank of a node declared lost never joins again (resilient_train.rank.fence)
    if moved_to is None and store.check([Keys.FINAL]):
        raise RunFinished()
    return join_generation(store, world_size=world_size, me=me, timeout=timeout,
                           finished=lambda: store.check([Keys.FINAL]), stopped=stopped, generation=moved_to,
                           elastic=elastic)


_SLICE_S = 0.1  # the main thread's wait on a join in slices: signal handlers run between them


def join_interruptibly(join: Callable[[], ResumePlan], *, requested: Callable[[], bool],
                       interrupt: Callable[[], None]) -> ResumePlan:
    """``join()`` (:func:`enter_generation` on a connection of its own) on a thread, while the calling main
    thread waits in slices, so that a preemption signal is acted on during a join too.

    A join blocks in one store call until every rank has come or its timeout has passed, and Python runs a
    signal's handler only between bytecodes of the main thread: a rank waiting for a peer that will never
    come (under plain torchrun a dead one: torchrun restarts every worker, with SIGTERM then SIGKILL after
    30 s) sat out the signal until it was killed. Once ``requested()`` turns true, ``interrupt()`` is
    called once (it stops the job: the join then ends with the stop), and the join's outcome is returned or
    raised as usual. Should ``interrupt()`` raise (the store did not take the stop), the join is still awaited
    (it ends by its own deadline; no thread is left holding its connection) and that error raised then.
    """
    outcome: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append(join())
        except BaseException as e:  # noqa: BLE001  (handed to the main thread)
            outcome.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=run, name="rt-join", daemon=True)
    thread.start()
    interrupted = False
    failed: Exception | None = None
    while not done.wait(_SLICE_S):
        if not interrupted and requested():
            interrupted = True
            try:
                interrupt()
            except Exception as e:  # noqa: BLE001  (raised once the join has ended)
                failed = e
    thread.join()  # done: it is leaving
    (result,) = outcome
    if failed is not None:
        raise failed
    if isinstance(result, BaseException):
        raise result
    return result
