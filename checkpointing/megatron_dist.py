"""Megatron-Core ``dist_checkpointing`` under this package's commit protocol.

Megatron writes the files (its ``torch_dist`` format: a ``.distcp`` shard per
rank, ``.metadata``, ``common.pt``, ``metadata.json``) and reshards them on
load across tensor and pipeline sizes; this module makes them a committed
checkpoint like any other here:

1. every rank saves into ``step-N.tmp/`` (``dist_checkpointing.save``, a collective);
2. each rank fsyncs and checksums the files it wrote (its own ``__{rank}_*.distcp``;
   rank 0 also the shared ones), and the lists are gathered on rank 0;
3. rank 0 checks that no file went unreported, writes ``manifest.json`` (sizes,
   SHA-256, the step, the world size, ``format: megatron.dist_checkpointing``),
   fsyncs, renames the directory into place and moves ``latest``; retention runs.

Load: the newest committed step whose manifest and checksums verify (rank 0
decides, every rank loads the same step), falling back to the one before; a
directory of the other format (the DCP manager's) is not taken for one of these.

``dist_checkpointing.save`` calls CUDA (it synchronises the device before
writing), so saving needs a GPU; verifying and choosing the step do not.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from checkpointing.catalog import iter_valid, step_dir, write_latest
from checkpointing.commit import TMP_SUFFIX, commit_directory
from checkpointing.durable import file_sha256, fsync_file, remove_tree
from checkpointing.manifest import MANIFEST_FILE, CheckpointError, FileEntry, Manifest
from checkpointing.retention import RetentionWorker
from monitors.events import EventLog

__all__ = ["FORMAT", "MegatronCheckpointConfig", "MegatronCheckpointFailed", "MegatronCheckpointer",
           "NoMegatronCheckpoint"]

FORMAT = "megatron.dist_checkpointing"
_RANK_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


class NoMegatronCheckpoint(FileNotFoundError):
    """No committed Megatron checkpoint under the directory verifies."""


class MegatronCheckpointFailed(RuntimeError):
    """A save was written but not committed (raised on every rank; the step directory stays ``.tmp``)."""


@dataclass(kw_only=True)
class MegatronCheckpointConfig:
    directory: str | os.PathLike[str]
    keep_last: int = 2
    keep_every: int = 0
    run_id: str | None = None
    console: bool = True  # rank 0 says on stderr which step it resumed from and what it skipped

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"MegatronCheckpointConfig.keep_last must be an int >= 1, got {self.keep_last!r}")
        if not isinstance(self.keep_every, int) or self.keep_every < 0:
            raise ValueError(f"MegatronCheckpointConfig.keep_every must be an int >= 0, got {self.keep_every!r}")


class MegatronCheckpointer:
    """Saves and loads Megatron sharded state dicts as committed, verified checkpoints (every rank calls)."""

    def __init__(self, config: MegatronCheckpointConfig, *, events: EventLog | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.config = config
        self.root = Path(config.directory)
        self.group = group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self._events = events if events is not None else EventLog(None, source=f"mckpt.rank{self.rank}")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        self._retention = (RetentionWorker(self.root, keep_last=config.keep_last, keep_every=config.keep_every,
                                           name="mckpt-retention") if self.rank == 0 else None)
        self.last_timings: dict[str, float] = {}

    # ------------------------------------------------------------- save
    def save(self, step: int, sharded_state_dict: dict[str, Any], *, extras: dict[str, Any] | None = None) -> Path:
        """Writes ``sharded_state_dict`` as step ``step`` and commits it; returns the step directory."""
        from megatron.core import dist_checkpointing

        return self.commit_with(step, lambda tmp: dist_checkpointing.save(sharded_state_dict, str(tmp)),
                                extras=extras)

    def commit_with(self, step: int, write: Callable[[Path], Any], *, extras: dict[str, Any] | None = None) -> Path:
        """The commit protocol around ``write(tmp_dir)``, a collective that writes the ``torch_dist`` layout
        (``save`` passes ``dist_checkpointing.save``; the CPU tests, which have no CUDA for it, write the same
        layout with ``torch.distributed.checkpoint``, which Megatron's ``torch_dist`` strategy writes through)."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"MegatronCheckpointer.save: step must be an int >= 0, got {step!r}")
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + TMP_SUFFIX)
        t0 = time.monotonic()
        if self.rank == 0:
            remove_tree(tmp)  # an earlier, crashed attempt at this step
            tmp.mkdir(parents=True)
        self._barrier()
        write(tmp)
        t_written = time.monotonic()
        mine = self._describe_own(tmp)
        reports = self._gather(mine)
        t_checksummed = time.monotonic()
        error = None
        if self.rank == 0:
            try:
                self._commit(tmp, final, step, reports, extras or {})
            except (CheckpointError, OSError) as e:
                error = str(e)
        error = self._agree(error)  # every rank learns the verdict (and none waits on a rank 0 that failed)
        if error is not None:
            self._events.emit("megatron_checkpoint_failed", step=step, rank=self.rank, reason=error)
            raise MegatronCheckpointFailed(f"Megatron checkpoint step {step} was not committed: {error}")
        t_done = time.monotonic()
        self.last_timings = {"write_s": t_written - t0, "checksum_s": t_checksummed - t_written,
                             "commit_s": t_done - t_checksummed, "total_s": t_done - t0}
        self._events.emit("megatron_checkpoint_committed", step=step, rank=self.rank,
                          **{k: round(v, 6) for k, v in self.last_timings.items()})
        return final

    def _describe_own(self, tmp: Path) -> dict[str, dict[str, Any]]:
        """Size and SHA-256 of the files this rank wrote (rank 0: also every file no rank owns by name)."""
        out = {}
        for f in sorted(tmp.iterdir()):
            if not f.is_file():
                continue
            m = _RANK_SHARD.match(f.name)
            owner = int(m.group(1)) if m else 0
            if owner != self.rank:
                continue
            fsync_file(f)
            size, digest = file_sha256(f)
            out[f.name] = {"size": size, "sha256": digest}
        return out

    def _commit(self, tmp: Path, final: Path, step: int, reports: list[dict[str, dict[str, Any]]],
                extras: dict[str, Any]) -> None:
        files: dict[str, FileEntry] = {}
        for report in reports:
            for name, e in report.items():
                files[name] = FileEntry(size=int(e["size"]), sha256=str(e["sha256"]))
        on_disk = {f.name for f in tmp.iterdir()} - {MANIFEST_FILE}
        unreported = sorted(on_disk - set(files))
        if unreported:  # a file nobody vouches for would be loaded unverified
            raise CheckpointError(tmp, unreported[0], "written by dist_checkpointing but reported by no rank "
                                                      "(a subdirectory, or a shard name this reader does not know)")
        manifest = Manifest(step=step, world_size=self.world_size, files=files, tree={"D": []},
                            extras={**extras, "format": FORMAT}, run_id=self.config.run_id)
        commit_directory(tmp, final, manifest)
        write_latest(self.root, step)
        if self._retention is not None:
            self._retention.request()

    # ------------------------------------------------------------- load
    def latest_step(self) -> int | None:
        """The newest committed Megatron checkpoint whose checksums verify (this rank's own reading)."""
        for entry, result in iter_valid(self.root, run_id=self.config.run_id):
            if isinstance(result, CheckpointError):
                self._invalid(entry.step, result.file, result.reason)
                continue
            if result.extras.get("format") != FORMAT:
                self._invalid(entry.step, MANIFEST_FILE, f"format {result.extras.get('format')!r}, not {FORMAT}")
                continue
            return entry.step
        return None

    def load(self, sharded_state_dict: dict[str, Any], *, strict: str | None = None) -> tuple[dict[str, Any], int]:
        """The newest verified step, loaded into ``sharded_state_dict`` (resharded as Megatron does)."""
        from megatron.core import dist_checkpointing

        step = self._agree(self.latest_step() if self.rank == 0 else None)
        if step is None:
            raise NoMegatronCheckpoint(f"no valid Megatron checkpoint under {self.root}")
        if self.config.console and self.rank == 0:
            print(f"resilient-train: loading Megatron checkpoint step {step} ({step_dir(self.root, step)})",
                  file=sys.stderr, flush=True)
        kwargs = {"strict": strict} if strict is not None else {}
        loaded = dist_checkpointing.load(sharded_state_dict, str(step_dir(self.root, step)), **kwargs)
        self._events.emit("megatron_checkpoint_loaded", step=step, rank=self.rank)
        return loaded, step

    def close(self) -> None:
        if self._retention is not None:
            self._retention.close()

    # ----------------------------------------------------------- helpers
    def _invalid(self, step: int, file: str | None, reason: str) -> None:
        self._events.emit("checkpoint_invalid", step=step, file=file, reason=reason, rank=self.rank)
        if self.config.console and self.rank == 0:
            print(f"resilient-train: Megatron checkpoint step {step} is not valid ({file or 'directory'}: "
                  f"{reason}); falling back to an older one", file=sys.stderr, flush=True)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def _gather(self, mine: dict[str, dict[str, Any]]) -> list[dict[str, dict[str, Any]]]:
        if not dist.is_initialized() or self.world_size == 1:
            return [mine]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, mine, group=self.group)
        return out

    def _agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not dist.is_initialized() or self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
