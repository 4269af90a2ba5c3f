"""A synchronous save, streamed: this rank's tensors written a piece at a time, from the rank itself.

A save with ``async_mode="disabled"`` blocks the caller until it is committed,
so nothing needs a staged copy that outlives the step: each piece (at most
``piece_bytes``, a larger tensor alone) is copied to host (a no-op for a CPU
tensor), written and fsync'd, and dropped before the next. Host memory stays
at one piece, not the whole state, and no writer process is started (its
import of torch would come out of a preemption's grace).

Each piece is a DCP writer of its own, numbered ``rank + k * world_size`` so
that the pieces of every rank have distinct names in the step directory; the
commit merges their metadata as it merges ranks' (:func:`checkpointing.commit.commit_checkpoint`).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from checkpointing import testhooks
from checkpointing.commit import describe_files
from checkpointing.dcp_io import write_shard
from checkpointing.shards import Chunk

__all__ = ["StreamAbandoned", "write_streamed"]


class StreamAbandoned(RuntimeError):
    """The caller stopped waiting: the pieces left are not written (the save fails, nothing is committed)."""


def write_streamed(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    world_size: int,
    step: int,
    chunks: dict[str, Chunk],
    piece_bytes: int,
    abandoned: threading.Event,
) -> dict[int, dict[str, dict[str, Any]]]:
    """Writes ``tensors`` into ``directory`` piece by piece; returns each piece's files by its writer number.

    ``abandoned`` is checked before every piece: once the caller gave up waiting, the tensors may change
    under the writer, so no further piece is written and the save fails.
    """
    testhooks.slow_write(step=step, rank=rank)
    files: dict[int, dict[str, dict[str, Any]]] = {}
    for k, piece in enumerate(_pieces(tensors, max(1, piece_bytes))):
        if abandoned.is_set():
            raise StreamAbandoned(f"rank {rank}: the save of step {step} was abandoned after {k} pieces")
        writer = rank + k * world_size
        host = {key: value.detach().to("cpu") for key, value in piece.items()}
        names = write_shard(directory, writer, host, chunks={key: c for key, c in chunks.items() if key in host})
        del host
        files[writer] = describe_files(directory, names)
    testhooks.crash_point("written", step=step, rank=rank)
    return files


def _pieces(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive runs of at most ``limit`` bytes; none when there is nothing to write."""
    pieces: list[dict[str, torch.Tensor]] = []
    size = 0
    for key, value in tensors.items():
        n = value.numel() * value.element_size()
        if not pieces or (pieces[-1] and size + n > limit):
            pieces.append({})
            size = 0
        pieces[-1][key] = value
        size += n
    return pieces
