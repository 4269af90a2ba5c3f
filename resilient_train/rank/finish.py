"""The end of a run: every rank agrees it is over, then rank 0 writes the final state.

A rank may die after finishing its last step: nobody leaves until every rank
has counted itself done (or the generation failed, and the last steps are
redone), and nobody but rank 0 leaves before the final state is committed (a
rank 0 dying while it writes is recovered like any other fault).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from monitors.events import EventLog

from resilient_train.base import exitcodes
from resilient_train.rank.errors import GenerationFailed, JobStopped
from resilient_train.base.exitfast import skip_final_collection
from resilient_train.rank.generation import RunFinished
from resilient_train.protocol.store import Keys, current_generation, fail_join, wait_until
from resilient_train.rank.local_state import LocalSlots
from resilient_train.rank.train_state import TrainState

__all__ = ["close_failed", "end_run", "finish_job", "finish_run", "full_tensor", "gather_sharded", "published_local_states", "sharded_state", "write_final",
           "write_final_state"]


def finish_run(
    store: dist.Store,
    *,
    generation: int,
    rank: int,
    world_size: int,
    moved: threading.Event,
    timeout: float,
    write_final: Callable[[], None] | None,
    gather: Callable[[], None] | None = None,
) -> None:
    """``gather`` runs on every rank once all are done (a collective: the sharded state to rank 0), before
    rank 0 writes."""
    store.add(Keys.done(generation), 1)

    def wait_or_fail(predicate: Callable[[], bool], what: str) -> None:
        wait_until(lambda: predicate() or moved.is_set() or store.check([Keys.FINAL]), timeout=timeout, what=what)
        if predicate():
            return
        if store.check([Keys.FINAL]):
            raise RunFinished()
        raise GenerationFailed(f"generation {generation} was declared failed")

    wait_or_fail(lambda: store.add(Keys.done(generation), 0) >= world_size, "every rank to finish")
    if gather is not None:
        gather()
    if rank == 0:
        if write_final is not None:
            write_final()
        store.set(Keys.FINAL, str(generation))
        current = current_generation(store)
        if current > generation:  # a replacement may be joining a generation nobody else will: it looks now
            fail_join(store, current, world_size=world_size)
    else:
        wait_or_fail(lambda: store.check([Keys.FINAL]), "the final state")


def finish_job(store: dist.Store, state: TrainState, *, generation: int, rank: int, world_size: int,
               moved: threading.Event, timeout: float, steps: int, run_dir: Path | None, events: EventLog,
               sharded: torch.nn.Module | None, suspended: Callable[[], AbstractContextManager[Any]],
               logical_ranks: int | None = None) -> None:
    """:func:`finish_run` with the final state written to ``run_dir`` (None: not written); ``sharded``:
    sup.sharded's module, gathered first on every rank (:func:`sharded_state`). ``world_size``: the
    generation's processes; ``logical_ranks``: whose local states the final state holds (every logical rank
    of an elastic job; by default one per process)."""
    gathered: list[dict[str, Any]] = []  # rank 0's sharded state, between the gather and the write

    def gather() -> None:
        assert sharded is not None
        state_ = sharded_state(sharded, state, suspended=suspended)
        if rank == 0:
            gathered.append(state_)
        else:
            gather_sharded(state_)

    def write() -> None:
        assert run_dir is not None
        write_final_state(store, state, run_dir, steps=steps, world_size=logical_ranks or world_size, events=events,
                          gathered=gathered.pop() if sharded is not None else None)

    finish_run(store, generation=generation, rank=rank, world_size=world_size, moved=moved, timeout=timeout,
               write_final=write if run_dir is not None else None,
               gather=gather if run_dir is not None and sharded is not None else None)


def close_failed(failures: list[tuple[str, str]], events: EventLog, *, rank: int, say: bool) -> None:
    """The parts that did not close cleanly (``Parts.close``): an event each, and a line each with ``say``."""
    for part, error in failures:
        events.emit("part_close_failed", rank=rank, part=part, error=error[:500])
        if say:
            print(f"resilient-train: rank {rank}: {part} did not close cleanly: {error.splitlines()[0]}",
                  file=sys.stderr, flush=True)


def end_run(events: EventLog, *, rank: int, step: int, recoveries: int, under_agent: bool, store_lost: str | None,
            stopped: JobStopped | None, preempted: bool) -> int | None:
    """The run's last event (``run_end``, with why it ended) and the rank's exit code; None: it finished."""
    skip_final_collection()  # the agent waits for this rank's exit before it can say the job ended
    pid = os.getpid()
    if store_lost is not None:
        events.emit("run_end", rank=rank, pid=pid, step=step, recoveries=recoveries, store_lost=store_lost)
        if not under_agent:  # under the agent, its line says it for the node
            print(f"resilient-train: rank {rank}: lost the coordination store ({store_lost}): "
                  "stopping; start the job again to resume from its newest checkpoint", file=sys.stderr, flush=True)
        return exitcodes.FAILED
    if stopped is not None:
        events.emit("run_end", rank=rank, pid=pid, step=step, recoveries=recoveries, stopped=stopped.reason)
        return stopped.exit_code
    if preempted:
        events.emit("run_end", rank=rank, pid=pid, step=step, recoveries=recoveries, preempted=True)
        return exitcodes.REQUEUE
    events.emit("run_end", rank=rank, pid=pid, step=step, recoveries=recoveries)
    return None


def published_local_states(store: dist.Store, *, world_size: int, step: int) -> dict[int, dict[str, Any]]:
    """Every rank's local state (data position, RNG states) as published at ``step``."""
    slots = LocalSlots(store)
    return {r: slots.read_decoded(r, step) for r in range(world_size)}


def write_final(store: dist.Store, state: TrainState, run_dir: Path, *, steps: int, world_size: int,
                replicated: dict[str, Any] | None = None,
                materialize: Callable[[Any], Any] | None = None) -> Path:
    """Rank 0: the whole job's state at its last step (every rank's local state from the store) to RUN_DIR/final.

    Streamed to disk a piece at a time (``checkpointing.write_state``): host memory for one piece, not the
    state. ``replicated``: a sharded state's model and optimizer, each DTensor made whole by ``materialize``
    as it is written (:func:`gather_sharded` runs the same collectives on the other ranks)."""
    from checkpointing import write_state

    locals_ = published_local_states(store, world_size=world_size, step=steps)
    for local in locals_.values():
        local.pop("rerun", None)  # the run's memory of faults, not training state
    path = run_dir / "final"
    write_state(path, state.state_dict(local_states=locals_, replicated=replicated), step=steps,
                extras={"world_size": world_size}, materialize=materialize)
    return path


def write_final_state(store: dist.Store, state: TrainState, run_dir: Path, *, steps: int, world_size: int,
                      events: EventLog, gathered: dict[str, Any] | None) -> None:
    """Rank 0: :func:`write_final`, timed (``final_state_written``); ``gathered``: a sharded state's
    :func:`sharded_state`, its DTensors made whole as they are written."""
    t0 = time.monotonic()
    path = write_final(store, state, run_dir, steps=steps, world_size=world_size, replicated=gathered,
                       materialize=full_tensor if gathered is not None else None)
    events.emit("final_state_written", path=str(path), step=steps, seconds=round(time.monotonic() - t0, 3))


def sharded_state(module: torch.nn.Module, state: TrainState, *,
                  suspended: Callable[[], AbstractContextManager[Any]]) -> dict[str, Any]:
    """Every rank: the sharded model and optimizer as DTensors (DCP's state_dict API); rank 0 streams them
    whole to disk one tensor at a time (:func:`write_final_state`), the others run the same gathers meanwhile
    (:func:`gather_sharded`). ``suspended``: the commit gate suspended."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    with suspended():  # DCP may step an optimizer with no state yet, to create it
        model_sd, optim_sd = get_state_dict(module, state.optimizer or [],
                                            options=StateDictOptions(full_state_dict=False))
    sharded: dict[str, Any] = {"model": model_sd}
    if state.optimizer is not None:
        sharded["optimizer"] = optim_sd
    if state.replicated:
        sharded["replicated"] = {name: obj.state_dict() for name, obj in state.replicated.items()}
    return sharded


def full_tensor(t: Any) -> Any:
    """A DTensor made whole (an all-gather over its mesh); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") and hasattr(t, "placements") else t


def gather_sharded(sharded: dict[str, Any]) -> None:
    """Not rank 0: the collectives of rank 0's streamed write of ``sharded``, in its order (results dropped)."""
    from checkpointing.tree import flatten_state

    flat, _ = flatten_state(sharded, dtensors=True)
    for t in flat.values():
        full_tensor(t)
