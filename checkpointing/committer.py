"""The committer thread of a :class:`~checkpointing.manager.CheckpointManager`: one save after another, its
write by the writer process (or streamed), the rank's report, and rank 0's commit and verdict.

A save's job (:class:`SaveJob`) is queued by ``CheckpointManager.save`` once its tensors are staged; this
thread runs it to COMMITTED or FAILED. The manager is a :class:`SaveCommitter`: the attributes below are
the manager's own, set in its ``__init__``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpointing import testhooks
from checkpointing.catalog import step_dir, write_latest
from checkpointing.commit import TMP_SUFFIX, commit_checkpoint
from checkpointing.config import CheckpointConfig
from checkpointing.coordinator import SaveCancelled, StoreCoordinator
from checkpointing.durable import remove_tree
from checkpointing.errors import FULL, StorageError, disk_full_error, storage_error, storage_fault
from checkpointing.lifecycle import SaveHandle, SavePhase
from checkpointing.retention import RetentionWorker
from checkpointing.shards import Chunk
from checkpointing.staging import HostStager
from checkpointing.streamed import write_streamed
from checkpointing.tree import Skeleton
from checkpointing.writer_process import WriterProcess
from monitors.events import EventLog

__all__ = ["SaveCommitter", "SaveJob"]


class _RanksFailed(OSError):
    def __init__(self, reason: str, storage: str | None) -> None:
        super().__init__(reason)
        self.storage = storage  # checkpointing.errors' kind of storage fault, if any rank's was one


@dataclass(kw_only=True)
class SaveJob:
    handle: SaveHandle
    coord: StoreCoordinator  # the generation the save was requested in
    tree: Skeleton | None
    local_tree: Skeleton | None
    chunks: dict[str, Chunk]  # staged keys that are chunks of a larger tensor (DTensor pieces)
    extras: dict[str, Any]
    cuda_event: Any
    version: int
    nbytes: int
    started: float
    # A synchronous save (async disabled): the live tensors, written a piece at a time (checkpointing.streamed)
    streamed: dict[str, Any] | None = None
    abandoned: threading.Event = field(default_factory=threading.Event)  # the caller stopped waiting
    written: threading.Event = field(default_factory=threading.Event)  # nothing reads the tensors any more


class SaveCommitter:
    """The committer thread's half of a :class:`~checkpointing.manager.CheckpointManager`."""

    config: CheckpointConfig
    rank: int
    world_size: int
    root: Path
    longest_save_s: float
    _events: EventLog
    _stager: HostStager
    _writer: WriterProcess
    _jobs: queue.Queue[SaveJob | None]
    _retention: RetentionWorker | None
    _last_committed: int | None
    _storage: StorageError | None

    def _notice(self, text: str) -> None:
        raise NotImplementedError  # the manager's

    def _commit_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run_job(job)
            except Exception as e:  # never kill the thread: the next save must still work
                if not job.handle.phase.terminal:
                    job.handle.move(SavePhase.FAILED, error=f"internal error: {e!r}")
                self._events.emit("checkpoint_failed", step=job.handle.step, rank=self.rank, reason=repr(e))

    def _run_job(self, job: SaveJob) -> None:
        h, step, timeout, coord = job.handle, job.handle.step, self.config.timeout_s, job.coord
        final = step_dir(self.root, step)
        tmp_dir = final.with_name(final.name + TMP_SUFFIX)
        h.move(SavePhase.WRITING)
        report: dict[str, Any]
        try:
            if job.cuda_event is not None:
                job.cuda_event.synchronize()
            tmp_dir.mkdir(parents=True, exist_ok=True)
            if tmp_dir.is_symlink():  # a link would have every rank write its shard wherever it points
                raise OSError(f"{tmp_dir} is a symbolic link, not a directory this job created")
            files: dict[str, Any] = {}
            writers: dict[str, Any] = {}
            if job.streamed is not None:
                pieces = write_streamed(tmp_dir, job.streamed, rank=self.rank, world_size=self.world_size, step=step,
                                        chunks=job.chunks, piece_bytes=int(self.config.piece_mb * 2**20), abandoned=job.abandoned)
                writers = {str(w): f for w, f in pieces.items()}
            elif self._stager.buffers:
                files = self._writer.write(
                    step=step, directory=tmp_dir, layout=self._stager.describe(), version=job.version, timeout=timeout,
                    chunks=job.chunks,
                )
            report = {"files": files, "writers": writers, "local_tree": job.local_tree}
        except Exception as e:
            report = {"error": f"rank {self.rank}: {e}", "storage": storage_fault(e)}
        finally:
            job.streamed = None  # the live tensors are not held past the write
            job.written.set()
        coord.report(step, report)
        testhooks.crash_point("reported", step=step, rank=self.rank)
        if "error" in report and self.rank != 0:
            self._fail(h, report["error"], storage=report["storage"])
            return
        h.move(SavePhase.COMMITTING)
        if self.rank != 0:
            try:
                verdict = coord.outcome(step, timeout)
            except (TimeoutError, SaveCancelled) as e:
                self._fail(h, str(e))
                return
            if verdict["ok"]:
                self._committed(h, job)
            else:
                self._fail(h, verdict["reason"], storage=verdict.get("storage"))
            return
        try:
            reports = coord.gather(step, timeout)
        except (TimeoutError, SaveCancelled) as e:
            # Left for the next save of this step, or retention, to remove: a rank still writing into it
            # must not race a deletion.
            coord.announce(step, ok=False, reason=str(e))
            self._fail(h, str(e))
            return
        failed = [r for r in reports.values() if "error" in r]
        try:
            if failed:
                kinds = {r.get("storage") for r in failed} - {None}
                raise _RanksFailed("; ".join(r["error"] for r in failed), FULL if FULL in kinds else next(iter(kinds), None))
            commit_checkpoint(
                tmp_dir,
                final,
                step=step,
                world_size=self.world_size,
                files_by_rank=_files_by_writer(reports),
                tree=job.tree or {"D": []},
                local_trees={r: rep["local_tree"] for r, rep in reports.items() if rep["local_tree"] is not None},
                extras=job.extras,
                run_id=self.config.run_id,
            )
            write_latest(self.root, step)
            testhooks.crash_point("latest", step=step, rank=self.rank)
        except Exception as e:
            kind = e.storage if isinstance(e, _RanksFailed) else storage_fault(e)
            reason = str(e)
            if kind == FULL and not isinstance(e, _RanksFailed):  # e.g. ENOSPC writing the manifest
                reason = str(disk_full_error(self.root, e, what=f"committing step {step}") or e)
            if not final.exists():
                remove_tree(tmp_dir)
            coord.announce(step, ok=False, reason=reason, storage=kind)
            self._fail(h, reason, storage=kind)
            return
        coord.announce(step, ok=True)
        self._committed(h, job)
        if self._retention is not None:
            self._retention.request()

    def _committed(self, h: SaveHandle, job: SaveJob) -> None:
        self._last_committed = h.step
        seconds = time.monotonic() - job.started
        self.longest_save_s = max(self.longest_save_s, seconds)
        self._events.emit(
            "checkpoint_committed",
            step=h.step,
            rank=self.rank,
            seconds=round(seconds, 6),
            bytes=job.nbytes,
        )
        h.move(SavePhase.COMMITTED)

    def _fail(self, h: SaveHandle, reason: str, *, storage: str | None = None) -> None:
        if storage is not None and self._storage is None:
            # Set before the handle ends: a caller woken by it must find it.
            self._storage = storage_error(storage, f"checkpoint step {h.step} under {self.root}: {reason}")
        h.disk_full = storage == FULL
        # Every failed save is said, not only logged: the next interval may fail the same way.
        self._notice(f"checkpoint step {h.step} failed: {reason}" + (
            "; checkpointing cannot go on: the job stops" if storage is not None else
            "; the next one is tried at its interval"))
        # The event first: a caller woken by the handle must find it in the log.
        self._events.emit("checkpoint_failed", step=h.step, rank=self.rank, reason=reason, disk_full=storage == FULL,
                          storage=storage)
        h.move(SavePhase.FAILED, error=reason)


def _files_by_writer(reports: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each DCP writer's files: a rank's, or the pieces of a streamed save (numbered ``rank + k * world``)."""
    files: dict[int, dict[str, Any]] = {}
    for rank, report in reports.items():
        if report["files"]:
            files[int(rank)] = report["files"]
        for writer, entries in (report.get("writers") or {}).items():
            files[int(writer)] = entries
    return files
