"""``CheckpointManager``: periodic, asynchronous, multi-rank checkpoints with an atomic commit.

A save: the caller's thread stages the tensors into reused host buffers and
returns (``blocking=False``). The rank's committer thread hands the buffers to
the persistent writer process, which writes and fsyncs this rank's shard; the
rank reports its files through the store; rank 0, once every rank reported,
commits (``.metadata``, manifest, rename, ``latest``) and announces the verdict.
Replicated entries are written by rank 0 only, ``config.local_keys`` by each rank.
A DTensor (sharded state: FSDP2, HSDP, TP) is written by the ranks holding it,
each its own chunk with its offsets in the global tensor, once per chunk
(:mod:`checkpointing.shards`); the commit checks the chunks tile every tensor.

Load: the newest committed step whose manifest and checksums verify, falling
back to older ones (each rejection is an event naming the file, and a line on
rank 0's stderr, as is the step resumed from). On a different number of ranks:
replicated entries load on any rank; rank ``r`` gets the local entries saved by
rank ``r`` if there was one, else none (the caller re-seeds). Sharded entries
load into a template of any layout (``load(into=...)``): each rank reads only
the stored chunks that overlap the pieces it holds.

A save that lost a rank is failed as soon as ``cancelled`` says so (see
``coordinator``); a save that ran out of disk makes every later ``save`` raise
:class:`~checkpointing.errors.DiskFullError` (the job must stop, not restart).
Rank 0 removes the ``.tmp`` leftovers of crashed saves when it starts: the
directory must belong to one job at a time (``resilient_train.agent.rundir`` locks it).

The committer thread (the write, the report, rank 0's commit) is :mod:`checkpointing.committer`.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from checkpointing import testhooks
from checkpointing.catalog import iter_valid, list_steps
from checkpointing.committer import SaveCommitter, SaveJob
from checkpointing.config import AsyncMode, CheckpointConfig, InFlightPolicy
from checkpointing.coordinator import Cancelled, StoreCoordinator
from checkpointing.errors import DiskFullError, StorageError
from checkpointing.lifecycle import MANAGER_MOVES, ManagerState, SaveHandle, SavePhase, check_move
from checkpointing.manifest import MANIFEST_FILE, CheckpointError, Manifest, verify_checkpoint
from checkpointing.retention import RetentionWorker, remove_leftovers
from checkpointing.shards import Chunk, rank_share
from checkpointing.staging import HostStager
from checkpointing.state_files import local_prefix, read_verified
from checkpointing.tree import Skeleton, fill_template, flatten_state
from checkpointing.writer_process import WriterProcess
from monitors.events import EventLog

__all__ = ["CheckpointManager", "NoCheckpointError"]


class NoCheckpointError(FileNotFoundError):
    """No committed checkpoint under the directory verifies."""


class CheckpointManager(SaveCommitter):
    def __init__(
        self,
        config: CheckpointConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        store: dist.Store | None = None,
        events: EventLog | None = None,
        cancelled: Cancelled | None = None,
        first_replica: bool = True,
    ) -> None:
        """``cancelled`` (a callable or a ``threading.Event``, polled from a background thread every
        ``coordinator.POLL_S`` while a save waits on other ranks) says the save in flight cannot complete,
        e.g. "my generation was declared failed"; ``set_store`` replaces it for later saves.

        ``first_replica=False``: another rank holds the same DTensor pieces as this one (a replica along a
        replicate dimension of the job's layout, such as HSDP's replica groups or TP × DP's ``dp``) and
        writes them; this rank writes only its local entries."""
        if not isinstance(config, CheckpointConfig):
            raise ValueError(f"CheckpointManager: config must be a CheckpointConfig, got {type(config).__name__}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"CheckpointManager: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.first_replica = first_replica
        self.root = Path(config.directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self._events = events if events is not None else EventLog(None, source=f"ckpt.rank{rank}")
        self._coord = StoreCoordinator(store, rank=rank, world_size=world_size, prefix=config.store_prefix,
                                       cancelled=cancelled)
        self._stager = HostStager()
        self._writer = WriterProcess(rank=rank)  # started by the first save; its imports overlap the staging
        self._state = ManagerState.OPEN
        self._inflight: SaveHandle | None = None
        self._last_committed: int | None = None
        self.longest_save_s = 0.0  # the longest save of this manager, from its request to its commit
        self._storage: StorageError | None = None  # a save failed for the storage: every later save raises it
        if rank == 0:  # one job per directory (the agent's run-directory lock): nobody else is mid-save
            removed = remove_leftovers(self.root)
            if removed:
                self._events.emit("checkpoint_leftovers_removed", directories=removed, rank=rank)
        self._jobs: queue.Queue[SaveJob | None] = queue.Queue()
        self._committer = threading.Thread(target=self._commit_loop, name=f"ckpt-commit-r{rank}", daemon=True)
        self._committer.start()
        self._retention = (
            RetentionWorker(self.root, keep_last=config.keep_last, keep_every=config.keep_every, name="ckpt-retention")
            if rank == 0
            else None
        )

    # ---- public API -------------------------------------------------------------------

    def set_store(self, store: dist.Store, *, cancelled: Cancelled | None = None, rank: int | None = None,
                  world_size: int | None = None) -> None:
        """Coordinates later saves through ``store`` (e.g. the next generation's prefix store), cancelled
        by ``cancelled`` (that generation's "declared failed"). A save in flight keeps its own. ``rank`` and
        ``world_size``: the writers of later saves changed (an elastic job's generation)."""
        if rank is not None and world_size is not None:
            self.rank, self.world_size = rank, world_size
            self._coord = StoreCoordinator(store, rank=rank, world_size=world_size, prefix=self.config.store_prefix,
                                           cancelled=cancelled)
            return
        self._coord = self._coord.rebound(store, cancelled)

    @property
    def disk_full(self) -> DiskFullError | None:
        """Set once a save failed because the disk is full (on every rank: rank 0's verdict says so)."""
        return self._storage if isinstance(self._storage, DiskFullError) else None

    @property
    def storage_error(self) -> StorageError | None:
        """Set once a save failed for the storage (full, read-only, failing I/O): checkpointing cannot go on."""
        return self._storage

    def save(
        self, step: int, state: dict[str, Any], *, extras: dict[str, Any] | None = None, blocking: bool = False,
        required: bool = False, wait_s: float | None = None, tag: str | None = None,
    ) -> SaveHandle:
        """Stages ``state`` and returns; with ``blocking`` (or async disabled) waits until it is committed.

        ``required`` (the last step's save, a preemption's): never skipped by the ``skip`` policy; it
        waits for the save in flight instead, at most ``wait_s`` (default ``config.timeout_s``); one
        still in flight then is left to finish and this save is skipped (a preemption's grace is over).
        A required save of the step the save in flight (or the last one) is of waits for that save and
        returns its handle once it commits, rather than write the step twice. ``tag``: the save's
        coordination keys are its own (:meth:`StoreCoordinator.tagged`), for a save every rank requests
        once (a preemption's) of a step that may have been saved, skipped or failed already.
        Raises :class:`DiskFullError` once a save failed for a full disk (:class:`UnwritableError` for a
        read-only or failing one): checkpointing cannot go on, and restarting ranks does not help.
        """
        self._check_open()
        self._raise_storage()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointManager.save: step must be an int >= 0, got {step!r}")
        if not isinstance(state, dict):
            raise ValueError(f"CheckpointManager.save: state must be a dict, got {type(state).__name__}")
        extras = dict(extras or {})
        try:
            json.dumps(extras, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"CheckpointManager.save: extras must be JSON data: {e}") from None
        previous = self._inflight
        if required and previous is not None and previous.step == step and previous.phase != SavePhase.FAILED:
            try:
                if previous.wait(self.config.timeout_s if wait_s is None else wait_s) is SavePhase.COMMITTED:
                    return previous
            except TimeoutError:
                if wait_s is None:
                    raise
                return previous  # still in flight: the caller's own wait says how it ended
        coord = self._coord.tagged(tag)
        if previous is not None and not previous.phase.terminal:
            if self.config.in_flight == InFlightPolicy.SKIP and not required:
                self._events.emit("checkpoint_skipped", step=step, in_flight=previous.step, rank=self.rank)
                coord.skip(step)  # the others give the step up at once instead of waiting for this rank
                return SaveHandle(step, SavePhase.SKIPPED)
            self._events.emit("checkpoint_waiting", step=step, in_flight=previous.step, rank=self.rank,
                              required=required)
            try:
                previous.wait(self.config.timeout_s if wait_s is None else wait_s)
            except TimeoutError:
                if wait_s is None:
                    raise
                # Its writer still reads the staging buffers: this save cannot stage into them.
                self._events.emit("checkpoint_skipped", step=step, in_flight=previous.step, rank=self.rank,
                                  reason=f"the save in flight did not finish within {wait_s:.3g} s")
                coord.skip(step)
                return SaveHandle(step, SavePhase.SKIPPED)
            self._raise_storage()  # the save waited for ran out of space, or found its storage read-only
        coord.unskip(step)  # a step this rank skipped before and saves now
        started = time.monotonic()
        if self.config.async_mode == AsyncMode.DISABLED:
            return self._save_streamed(step, state, extras, started, coord)
        self._writer.start()  # no-op once running; (re)starts a dead one without waiting for it
        tensors, tree, local_tree, chunks = self._share(state)
        handle = SaveHandle(step)
        self._inflight = handle
        try:
            event = self._stager.stage(
                tensors, midway=lambda: testhooks.crash_point("staging", step=step, rank=self.rank)
            )
        except BaseException as e:
            handle.move(SavePhase.FAILED, error=f"staging failed: {e}")
            raise
        testhooks.crash_point("staged", step=step, rank=self.rank)
        blocked = time.monotonic() - started
        self._events.emit(
            "checkpoint_staged", step=step, rank=self.rank, seconds=round(blocked, 6), bytes=self._stager.nbytes
        )
        self._jobs.put(
            SaveJob(
                handle=handle,
                coord=coord,
                tree=tree,
                local_tree=local_tree if self.config.local_keys else None,
                chunks=chunks,
                extras=extras,
                cuda_event=event,
                version=self._stager.layout_version,
                nbytes=self._stager.nbytes,
                started=started,
            )
        )
        if blocking or self.config.async_mode == AsyncMode.DISABLED:
            handle.wait(self.config.timeout_s)
        return handle

    def _save_streamed(self, step: int, state: dict[str, Any], extras: dict[str, Any], started: float,
                       coord: StoreCoordinator) -> SaveHandle:
        """A synchronous save: no staging copy, no writer process; the committer thread writes the live
        tensors a piece at a time while this thread waits (so nothing changes them meanwhile)."""
        tensors, tree, local_tree, chunks = self._share(state)
        handle = SaveHandle(step)
        self._inflight = handle
        job = SaveJob(handle=handle, coord=coord, tree=tree,
                   local_tree=local_tree if self.config.local_keys else None, chunks=chunks, extras=extras,
                   cuda_event=None, version=-1, nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                   started=started, streamed=tensors)
        self._jobs.put(job)
        try:
            handle.wait(self.config.timeout_s)
        except TimeoutError:
            # The caller goes on and may change the tensors: no piece may be written after this.
            job.abandoned.set()
            job.written.wait(self.config.timeout_s)
            raise
        return handle

    def prepare(self, state: dict[str, Any]) -> None:
        """Starts the writer and allocates the staging buffers for ``state``'s layout now,
        so that the first save costs one copy like every later one (call it at start-up)."""
        self._check_open()
        if self.config.async_mode == AsyncMode.DISABLED:
            return  # saves are streamed from the live tensors: nothing to allocate, no writer to start
        previous = self._inflight
        if previous is not None and not previous.phase.terminal:
            previous.wait(self.config.timeout_s)
        self._writer.start()
        self._stager.prepare(self._share(state)[0])

    def _share(self, state: dict[str, Any]) -> tuple[dict[str, Any], Skeleton | None, Skeleton, dict[str, Chunk]]:
        """What this rank writes: ``(tensors, tree (rank 0), local tree, chunks)``.

        Every rank walks the replicated entries, because a DTensor among them is written by the ranks that
        hold it; plain tensors there are the same on every rank and written by rank 0.
        """
        local_keys = set(self.config.local_keys)
        replicated = {k: v for k, v in state.items() if k not in local_keys}
        local = {k: v for k, v in state.items() if k in local_keys}
        flat, tree = flatten_state(replicated, dtensors=True)
        tensors, chunks = rank_share(flat, rank=self.rank, primary=self.first_replica)
        local_tensors, local_tree = flatten_state(local, prefix=local_prefix(self.rank))
        tensors.update(local_tensors)
        return tensors, tree if self.rank == 0 else None, local_tree, chunks

    def wait(self, timeout: float | None = None) -> SavePhase | None:
        """Waits for the save in flight, if any; returns its final phase."""
        handle = self._inflight
        if handle is None:
            return None
        return handle.wait(self.config.timeout_s if timeout is None else timeout)

    def latest_step(self, *, verify: bool = False) -> int | None:
        """The newest step with a valid manifest; with ``verify``, also with every file's checksum."""
        if verify:
            for entry, result in iter_valid(self.root, run_id=self.config.run_id):
                if not isinstance(result, CheckpointError):
                    return entry.step
                self._invalid(entry.step, result)
            return None
        for entry in reversed(list_steps(self.root)):
            try:
                if Manifest.read(entry.path).step == entry.step:
                    return entry.step
            except CheckpointError:
                continue
        return None

    def load(
        self, template: dict[str, Any] | None = None, *, step: int | None = None,
        into: Callable[[Manifest], dict[str, Any] | None] | None = None, every_rank: bool = False,
    ) -> tuple[dict[str, Any], Manifest]:
        """The newest (or the given) committed step that verifies, as this rank saved it (``every_rank``: with
        every rank's own entries, under ``RANKS_KEY``, instead of this rank's).

        With ``template``, its tensors are filled in place (shapes and dtypes must
        match) and its structure returned; otherwise fresh CPU tensors.

        ``into(manifest)``, called once a step verified, may return part of the state (``{"model": ...}``)
        whose tensors receive the checkpoint's values directly: whole tensors, or DTensors of any layout
        (another world size or mesh than the one that saved it), each rank reading only the stored
        chunks that overlap its pieces. The state returned holds those very tensors.
        """
        for entry in reversed(list_steps(self.root)):
            if step is not None and entry.step != step:
                continue  # not verified: only the step asked for is read
            try:
                manifest = verify_checkpoint(entry.path, run_id=self.config.run_id)
                if manifest.step != entry.step:
                    raise CheckpointError(entry.path, MANIFEST_FILE, f"manifest says step {manifest.step}")
                targets = into(manifest) if into is not None else None
                flat = flatten_state(targets, dtensors=True)[0] if targets else None
                state = read_verified(entry.path, manifest, rank=None if every_rank else self.rank, into=flat)
            except CheckpointError as e:
                self._invalid(entry.step, e)
                continue
            self._events.emit(
                "checkpoint_loaded", step=entry.step, saved_world_size=manifest.world_size, world_size=self.world_size,
                rank=self.rank,
            )
            self._notice(f"resuming from checkpoint step {entry.step} ({entry.path}, saved by "
                         f"{manifest.world_size} rank(s))")
            if template is not None:
                state = fill_template(template, state)
            return state, manifest
        wanted = f"step {step}" if step is not None else "any step"
        raise NoCheckpointError(f"no valid checkpoint ({wanted}) under {self.root}")

    def _invalid(self, step: int, e: CheckpointError) -> None:
        self._events.emit("checkpoint_invalid", step=step, file=e.file, reason=e.reason, rank=self.rank)
        self._notice(f"checkpoint step {step} is not valid ({e.file or 'directory'}: {e.reason}); "
                     "falling back to an older one")

    def _notice(self, text: str) -> None:
        """Resume, fallback and a full disk are told on the console too, not only in events.jsonl."""
        if self.config.console and self.rank == 0:
            print(f"resilient-train: {text}", file=sys.stderr, flush=True)

    def close(self, timeout: float | None = None) -> None:
        """Waits for the save in flight, stops the committer, retention and writer."""
        if self._state != ManagerState.OPEN:
            return
        timeout = self.config.timeout_s if timeout is None else timeout
        self._move(ManagerState.CLOSING)
        try:
            if self._inflight is not None:
                self._inflight.wait(timeout)
        finally:
            self._jobs.put(None)
            self._committer.join(timeout)
            if self._retention is not None:
                self._retention.close(timeout)
            self._writer.close(timeout)
            self._stager.release()
            self._move(ManagerState.CLOSED)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writer_pid(self) -> int | None:
        return self._writer.pid

    def _raise_storage(self) -> None:
        if self._storage is not None:
            raise type(self._storage)(self._storage.message)

    def _check_open(self) -> None:
        if self._state != ManagerState.OPEN:
            raise RuntimeError(f"CheckpointManager is {self._state.value}")

    def _move(self, new: ManagerState) -> None:
        check_move(MANAGER_MOVES, self._state, new)
        self._state = new

