"""``CheckpointConfig``: everything the checkpoint manager is told, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path


__all__ = ["AsyncMode", "CheckpointConfig", "InFlightPolicy"]


class AsyncMode(str, Enum):
    DISABLED = "disabled"  # every save blocks until committed
    PROCESS = "process"  # stage, then a persistent writer process writes; training goes on


class InFlightPolicy(str, Enum):
    WAIT = "wait"  # a save requested while one is in flight waits for it
    SKIP = "skip"  # ... or is skipped (and logged)


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often to checkpoint, what to keep, and how saves overlap training.

    ``local_keys`` names the top-level entries of the state that differ per rank
    (RNG states, per-rank counters): each rank writes its own; everything else is
    replicated (data-parallel model and optimizer) and written once, by rank 0.
    Store the data position as a global sample index among the replicated
    entries, so it means the same thing on any number of ranks.
    """

    directory: str | os.PathLike[str]  # a run config's default: RUN_DIR/checkpoints
    interval: int = 0  # save every `interval` steps (see should_save); 0: only when asked
    keep_last: int = 2  # the newest K committed checkpoints are kept
    keep_every: int = 0  # and every step divisible by N, forever (0: none)
    async_mode: AsyncMode | str = AsyncMode.PROCESS  # process: a writer process saves while training goes on
    in_flight: InFlightPolicy | str = InFlightPolicy.WAIT  # a save asked for while one is in flight: wait or skip
    local_keys: tuple[str, ...] = ()  # top-level state entries that differ per rank (each rank writes its own)
    run_id: str | None = None  # written into manifests; loading rejects other runs' manifests when set
    timeout_s: float = 600.0  # bound on every wait of a save: writer, peers, commit
    store_prefix: str = "ckpt"  # the checkpoints' keys in the store
    console: bool = True  # rank 0 tells resume, fallback and a full disk on stderr too (not only in events)
    piece_mb: float = 128.0  # a synchronous save (async_mode="disabled") holds at most this much on the host at once

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        try:
            self.async_mode = AsyncMode(self.async_mode)
        except ValueError:
            raise ValueError(
                f"CheckpointConfig.async_mode must be one of {[m.value for m in AsyncMode]}, got {self.async_mode!r}"
            ) from None
        try:
            self.in_flight = InFlightPolicy(self.in_flight)
        except ValueError:
            raise ValueError(
                f"CheckpointConfig.in_flight must be one of {[m.value for m in InFlightPolicy]}, got {self.in_flight!r}"
            ) from None
        for name in ("interval", "keep_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"CheckpointConfig.{name} must be an int >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"CheckpointConfig.keep_last must be an int >= 1, got {self.keep_last!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0 \
                or self.timeout_s == float("inf"):
            raise ValueError(f"CheckpointConfig.timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        if isinstance(self.piece_mb, bool) or not isinstance(self.piece_mb, (int, float)) \
                or not 0 < self.piece_mb <= 2**20:
            raise ValueError(f"CheckpointConfig.piece_mb must be a number in (0, 1048576], got {self.piece_mb!r}")
        self.local_keys = tuple(self.local_keys)
        if not all(isinstance(k, str) and k for k in self.local_keys):
            raise ValueError(f"CheckpointConfig.local_keys must be non-empty strings, got {self.local_keys!r}")

    def should_save(self, step: int) -> bool:
        return self.interval > 0 and step > 0 and step % self.interval == 0
