"""The end of a run: every rank agrees it is over, then rank 0 writes the final state.

A rank may die after finishing its last step: nobody leaves until every rank
has counted itself done (or the generation failed, and the last steps are
redone), and nobody but rank 0 leaves before the final state is committed (a
rank 0 dying while it writes is recovered like any other fault).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from resilient_train.errors import GenerationFailed
from resilient_train.generation import RunFinished
from resilient_train.store import Keys, current_generation, fail_join, wait_until
from resilient_train.local_state import LocalSlots
from resilient_train.train_state import TrainState

__all__ = ["finish_run", "full_tensor", "gather_sharded", "published_local_states", "write_final"]


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


def full_tensor(t: Any) -> Any:
    """A DTensor made whole (an all-gather over its mesh); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") and hasattr(t, "placements") else t


def gather_sharded(sharded: dict[str, Any]) -> None:
    """Not rank 0: the collectives of rank 0's streamed write of ``sharded``, in its order (results dropped)."""
    from checkpointing.tree import flatten_state

    flat, _ = flatten_state(sharded, dtensors=True)
    for t in flat.values():
        full_tensor(t)
