"""Disk checkpoints inside the supervisor: periodic async saves and the fallback load.

Live replicas cover a lost rank whose peers are alive. The disk is for
everything else: a launcher that restarted every worker (plain torchrun), a
job started again, or a fault that left no step held by every rank (a lost
rank and its buddy at once). The train state goes to disk as ``{"model",
"optimizer", "replicated", "local"}``, where ``local`` (the data position and
RNG states) is written by each rank for itself. Sharded state (``sup.sharded``)
is written in DCP's form, each rank its own chunks (:mod:`resilient_train.rank.dcp_state`),
and loads on any layout: another world size, another mesh, a data-parallel model.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from checkpointing import CheckpointConfig, CheckpointManager, NoCheckpointError
from checkpointing.lifecycle import SaveHandle, SavePhase
from checkpointing.manifest import Manifest
from checkpointing.state_files import RANKS_KEY
from monitors import EventLog
from monitors.persist import CHECKPOINT_EXTRAS_KEY, offer_from_checkpoint, read_monitor_state
from resilient_train.rank.dcp_state import (
    DCP_FORM, FORM_KEY, Suspend, dcp_state_dict, dcp_targets, load_dcp_state, saveable,
)
from resilient_train.rank.errors import UsageError, WrongInput
from resilient_train.rank.elastic.width import Width
from resilient_train.rank.fence import check_fence
from resilient_train.rank.local_state import LocalSlots
from resilient_train.protocol.store import Keys, scoped, wait_until
from resilient_train.rank.train_state import TrainState

__all__ = ["DiskCheckpoints", "default_checkpoint_config"]

LOCAL_KEY = "local"
LOGICAL_KEY = "logical"  # an elastic job's checkpoint: {logical rank: its local state}, written once
DEFAULT_TIMEOUT_S: float = CheckpointConfig.timeout_s  # of a save's every wait, when no checkpoint is configured


def default_checkpoint_config(run_dir: str | Path, every: int, *, mode: str = "process") -> CheckpointConfig:
    """Saves every ``every`` steps under RUN_DIR/checkpoints: the supervisor's one preset, what a run config's
    ``checkpoint`` section with ``interval: every`` gives (``--checkpoint.interval=N``), the fields' defaults
    otherwise. A save asked for while the previous one is in flight waits for it (``in_flight="wait"``): the
    interval is the most steps a resume can lose, and a slow disk shows as a stall (its ``checkpoint_waiting``
    event) instead of checkpoints silently skipped. ``mode="disabled"`` makes every save block until committed.
    The supervisor adds its own per-rank entry (:data:`LOCAL_KEY`) to any config's ``local_keys``."""
    return CheckpointConfig(directory=Path(run_dir) / "checkpoints", interval=every, async_mode=mode)


class DiskCheckpoints:
    def __init__(
        self, config: CheckpointConfig, *, rank: int, world_size: int, store: dist.Store, events: EventLog,
        run_dir: Path | None = None, sharded: bool = False, first_replica: bool = True,
        suspended: Suspend = contextlib.nullcontext, width: Callable[[], Width] | None = None,
    ) -> None:
        """``sharded``: the state is written in DCP's form (``sup.sharded``); ``first_replica=False``: another
        rank holds this rank's shards and writes them; ``suspended()``: the commit gate kept out of an
        optimizer step that DCP makes to create an empty optimizer's state. ``width()``: an elastic job's
        layout in this generation (resilient_train.rank.elastic): its writers are the generation's processes, and
        every logical rank's local state is saved once, under :data:`LOGICAL_KEY`."""
        if LOCAL_KEY not in config.local_keys:
            # The supervisor's own per-rank entry (RNG, data position): not the user's to list. A run config's
            # checkpoint section (--checkpoint.interval=N) does not, and every rank died of it.
            config = replace(config, local_keys=(*config.local_keys, LOCAL_KEY))
        self.config = config
        self.rank = rank
        self.sharded = sharded
        self._suspended = suspended
        self._events = events
        # Under the agent: the computed hang timeouts travel in each checkpoint (monitors.persist).
        self.run_dir = run_dir
        self._prepared = False
        self._close_by: float | None = None  # after a preemption's save: close() waits no later (monotonic)
        self._store: dist.Store | None = None  # the generation's store, for the fence check
        self._width = width
        self._slots = LocalSlots(store)  # every logical rank's published local state (an elastic job's save)
        # Re-pointed at each generation's keys by on_generation.
        self._manager = CheckpointManager(
            config, rank=rank, world_size=world_size, store=scoped(store, "rt/ckpt-unused"), events=events,
            first_replica=first_replica,
        )

    def _lead(self) -> bool:
        """This rank speaks for the job (rank 0; an elastic job's lowest member: rank 0 may be gone)."""
        return (self._width().group_rank(self.rank) if self._width is not None else self.rank) == 0

    def on_generation(self, store: dist.Store, generation: int) -> None:
        # Saves of a failed generation never mix their reports with the next one's.
        # A save that loses a rank fails at once for the others: the generation was declared failed.
        self._store = store
        layout = {}
        if self._width is not None:
            w = self._width()
            layout = {"rank": w.group_rank(self.rank), "world_size": w.size}
        self._manager.set_store(scoped(store, Keys.gen_scope(generation, "ckpt")),
                                cancelled=lambda: store.check([Keys.fault(generation)]), **layout)

    def prepare(self, state: TrainState) -> None:
        """Starts the writer process and sizes the staging buffers now, not at the first save."""
        if not self._prepared:
            if self.sharded and not saveable(state):
                self._manager.prepare({})  # the writer starts; the first save sizes the buffers
                return
            self._manager.prepare(self._state_dict(state))
            self._prepared = True

    @property
    def longest_save_s(self) -> float:
        """The longest save so far, from its request to its commit (the preemption's grace covers two)."""
        return self._manager.longest_save_s

    def check_storage(self) -> None:
        """Raises the storage fault a save met (a full, read-only or failing filesystem): the job stops at the
        next boundary, not at the next interval."""
        error = self._manager.storage_error
        if error is not None:
            raise type(error)(error.message)

    def save(self, state: TrainState, *, required: bool = False, wait_s: float | None = None,
             tag: str | None = None) -> SaveHandle:
        """Saves the boundary ``state.step`` (the caller checked ``config.should_save``).

        ``required`` (the last step's save): never skipped for a save still in flight (waited for at most
        ``wait_s``); ``tag``: coordination keys of its own (``CheckpointManager.save``).
        """
        if self._store is not None:
            check_fence(self._store, "checkpoint")  # a lost node's rank writes nothing (resilient_train.rank.fence)
        extras: dict[str, Any] = {FORM_KEY: DCP_FORM} if self.sharded else {}
        if self._lead() and self.run_dir is not None:  # rank 0 writes the manifest
            monitors = read_monitor_state(self.run_dir)
            if monitors is not None:
                extras[CHECKPOINT_EXTRAS_KEY] = monitors
        return self._manager.save(state.step, self._state_dict(state), extras=extras, required=required,
                                  wait_s=wait_s, tag=tag)

    def save_now(self, state: TrainState, *, deadline: float, exit_by: float) -> bool:
        """Saves ``state.step`` and waits for the commit (a preemption); True once committed.

        The save in flight, if any, and this one are waited for until ``deadline`` (monotonic); closing
        waits no later than ``exit_by``."""
        self._close_by = exit_by
        handle = self.save(state, required=True, wait_s=max(0.0, deadline - time.monotonic()), tag="preemption")
        try:
            return handle.wait(max(0.0, deadline - time.monotonic())) is SavePhase.COMMITTED
        except TimeoutError:  # still being written: it may yet commit, but this rank's grace is over
            return False

    def load_agreed(self, state: TrainState, store: dist.Store, generation: int, *, timeout: float,
                    steps: int | None = None) -> tuple[int | None, dict[int, dict[str, Any]] | None]:
        """Every rank loads the same step: rank 0 picks the newest committed one.

        Returns the step loaded (None when there is no checkpoint at all) and, for an elastic job, every
        logical rank's local state the checkpoint holds (by logical rank: a fixed-width job's checkpoint
        holds rank r's as logical rank r's; the caller loads those it computes). A checkpoint past ``steps``,
        the run's last step, is the user's input contradicting itself (``--steps 20`` in a run directory that
        holds step 30): every rank raises the same :class:`WrongInput` before loading anything (exit code 2).
        """
        key = Keys.gen_scope(generation, "disk_step")
        if self._lead():
            latest = self._manager.latest_step(verify=True)  # the newest whose checksums verify
            store.set(key, "" if latest is None else str(latest))
        else:
            wait_until(lambda: store.check([key]), timeout=timeout, what="the step to load from disk")
        chosen = store.get(key).decode()
        if not chosen:
            return None, None
        if steps is not None and int(chosen) > steps:
            raise WrongInput(f"steps={steps} is below step {chosen} of the checkpoint it would resume from "
                             f"({self.config.directory}): train to step {chosen} or more, or start in another run "
                             "directory")
        try:
            loaded, manifest = self._manager.load(step=int(chosen), into=lambda m: self._targets(state, m),
                                                  every_rank=self._width is not None)
        except NoCheckpointError:
            raise RuntimeError(f"checkpoint step {chosen} chosen by rank 0 does not verify on rank {self.rank}") from None
        monitors = manifest.extras.get(CHECKPOINT_EXTRAS_KEY)
        if self._lead() and self.run_dir is not None and isinstance(monitors, dict):
            try:
                offer_from_checkpoint(self.run_dir, monitors, step=int(chosen))
            except OSError as e:  # the monitors' timeouts are a convenience: never fail the load for them
                self._events.emit("monitor_state_not_offered", step=int(chosen), reason=str(e))
        if manifest.extras.get(FORM_KEY) == DCP_FORM:
            load_dcp_state(state, loaded, self._suspended)
        else:
            state.load_replicated(loaded)
        logical: dict[int, dict[str, Any]] = {int(x): sd for x, sd in loaded.get(LOGICAL_KEY, {}).items()}
        for r, entries in loaded.get(RANKS_KEY, {}).items():
            if LOCAL_KEY in entries:
                logical.setdefault(int(r), entries[LOCAL_KEY])
        mine = loaded[LOCAL_KEY] if LOCAL_KEY in loaded else logical.get(self.rank)
        if mine is not None:
            state.load_local(mine)
        else:
            # Saved on fewer ranks: this rank had no predecessor. The step is
            # the data position; its RNG streams stay as the script seeded them.
            state.step = int(chosen)
        return int(chosen), logical if self._width is not None else None

    def close(self) -> None:
        by = self._close_by
        self._manager.close(None if by is None else max(0.1, by - time.monotonic()))

    def _targets(self, state: TrainState, manifest: Manifest) -> dict[str, Any] | None:
        """What the checkpoint is read into: the live model and optimizer in DCP's form, on this layout."""
        if manifest.extras.get(FORM_KEY) == DCP_FORM:
            return dcp_targets(state, self._suspended)
        if self.sharded:
            raise UsageError(f"checkpoint step {manifest.step} under {self.config.directory} holds a data-parallel "
                             "job's state (its optimizer keyed by parameter index, every tensor whole); a job with "
                             "sup.sharded loads checkpoints of sharded state only")
        return None

    def _state_dict(self, state: TrainState) -> dict:
        replicated = dcp_state_dict(state, self._suspended) if self.sharded else state.replicated_state_dict()
        if self._width is None:
            return {**replicated, LOCAL_KEY: state.local_state_dict()}
        # An elastic job: every logical rank's local state, as each published it for this boundary, written
        # once by the generation's first process (plain tensors are written by rank 0 only).
        w = self._width()
        if w.group_rank(self.rank) != 0:
            return replicated
        return {**replicated, LOGICAL_KEY: {str(x): self._slots.read_decoded(x, state.step) for x in range(w.width)}}
