"""What the rerun flow needs from the process group and the store: the shared table and the stop save."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from resilient_train.rank.local_state import LocalSlots
from resilient_train.protocol.store import Keys, wait_until
from resilient_train.rank.train_state import TrainState

__all__ = ["save_for_stop", "shared_table"]


def shared_table(row: list[float], *, rank: int, world_size: int, device: torch.device) -> list[list[float]]:
    """Every rank's ``row``, to every rank: one all-reduce of a table with a row per rank."""
    table = torch.zeros(world_size, len(row), dtype=torch.float64, device=device)
    table[rank] = torch.tensor(row, dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(table)
    return table.cpu().tolist()


def save_for_stop(store: dist.Store, state: TrainState, step: int, *, rank: int, world_size: int, generation: int,
                  run_dir: Path | None, timeout_s: float) -> str | None:
    """Rank 0 writes the state of ``step`` (the last good one) to the run dir; the others wait for it."""
    key = Keys.gen_scope(generation, "rerun/saved")
    if rank == 0:
        path = ""
        if run_dir is not None:
            from checkpointing import write_state

            slots = LocalSlots(store)
            locals_ = {r: slots.read_decoded(r, step) for r in range(world_size)}
            path = str(run_dir / f"rerun-stop-step-{step}")
            write_state(path, state.state_dict(local_states=locals_), step=step, extras={"world_size": world_size})
        store.set(key, path)
        return path or None
    wait_until(lambda: store.check([key]), timeout=timeout_s, what="the saved state")
    return store.get(key).decode() or None
