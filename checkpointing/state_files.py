"""Single-process checkpoint files: ``write_state`` and ``read_state``.

``write_state`` is the synchronous, one-process form of the commit protocol (used
for final states and by tools); the :class:`~checkpointing.manager.CheckpointManager`
writes the same format from many ranks. ``read_state`` reads either.

``write_state`` streams: the tensors go to host memory and to disk a piece of
at most ``piece_mb`` at a time (each piece its own DCP file, as a rank's shard
would be, merged into one ``.metadata`` at the commit), so a state on a GPU
never needs host memory for more than one piece (and one tensor larger than
a piece). DCP's own writer keeps every tensor of a file until the file is
written, so one file for the whole state would copy all of it to the host.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from checkpointing.commit import TMP_SUFFIX, commit_checkpoint, describe_files
from checkpointing.dcp_io import read_tensors, write_shard
from checkpointing.durable import remove_tree
from checkpointing.errors import storage_error_for
from checkpointing.manifest import Manifest, verify_checkpoint
from checkpointing.tree import flatten_state, skeleton_keys, unflatten_state

__all__ = ["LOCAL_PREFIX", "PIECE_MB", "RANKS_KEY", "local_prefix", "read_state", "read_verified", "write_state"]

PIECE_MB = 128.0  # host memory a streaming write holds at once (a larger tensor goes alone)

LOCAL_PREFIX = "__rank"
RANKS_KEY = "__ranks__"


def local_prefix(rank: int) -> str:
    """Key prefix of a rank's own (not replicated) entries inside the DCP files."""
    return f"{LOCAL_PREFIX}{rank}__"


def write_state(
    directory: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    step: int,
    extras: dict[str, Any] | None = None,
    run_id: str | None = None,
    piece_mb: float = PIECE_MB,
    materialize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Path:
    """Writes ``state`` as a committed checkpoint at ``directory`` and returns its path.

    Tensors go to DCP files (``dcp.load`` reads them), ``piece_mb`` of them at a
    time, plain values into the manifest. The directory appears complete or not
    at all. A full filesystem raises :class:`~checkpointing.errors.DiskFullError`
    (one line naming the directory).

    ``materialize`` turns each tensor into the one written, in the order of the
    state (a DTensor's ``full_tensor()``: a collective the other ranks run in the
    same order, so a sharded state is gathered one tensor at a time).
    """
    if not isinstance(state, dict):
        raise ValueError(f"write_state: state must be a dict, got {type(state).__name__}")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"write_state: step must be a non-negative int, got {step!r}")
    final = Path(directory)
    if final.name.endswith(TMP_SUFFIX):
        raise ValueError(f"write_state: directory name must not end in {TMP_SUFFIX!r}: {final}")
    flat, tree = flatten_state(state, dtensors=materialize is not None)
    extras = dict(extras or {})
    tmp = final.with_name(final.name + TMP_SUFFIX)
    remove_tree(tmp)
    tmp.mkdir(parents=True)
    try:
        files: dict[int, dict[str, dict[str, Any]]] = {}
        for i, piece in enumerate(_pieces(flat, max(1, int(piece_mb * 2**20)))):
            host = {k: (v if materialize is None else materialize(v)).detach().to("cpu") for k, v in piece.items()}
            files[i] = describe_files(tmp, write_shard(tmp, i, host))
            del host
        commit_checkpoint(
            tmp,
            final,
            step=step,
            world_size=1,
            files_by_rank=files,
            tree=tree,
            local_trees={},
            extras=extras,
            run_id=run_id,
        )
    except BaseException as e:
        remove_tree(tmp)
        fault = storage_error_for(final.parent, e, what=f"writing {final}") if isinstance(e, OSError) else None
        if fault is not None and fault is not e:
            raise fault from None  # e.g. ENOSPC writing the manifest, EROFS: name the directory
        raise
    return final


def _pieces(flat: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive runs of ``flat`` of at most ``limit`` bytes (at least one run, maybe empty)."""
    pieces: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in flat.items():
        n = value.numel() * value.element_size()
        if pieces[-1] and size + n > limit:
            pieces.append({})
            size = 0
        pieces[-1][key] = value
        size += n
    return pieces


def read_state(
    directory: str | os.PathLike[str],
    *,
    rank: int | None = None,
    run_id: str | None = None,
) -> tuple[dict[str, Any], Manifest]:
    """Verifies a committed checkpoint (manifest, sizes, checksums), then reads it.

    ``rank=None`` returns the whole checkpoint: the replicated state, plus each
    saving rank's own entries under ``"__ranks__"`` when there are any. ``rank=r``
    returns what rank ``r`` saved (replicated entries and its own); a rank the
    checkpoint has no entries for gets the replicated entries only.
    Raises :class:`~checkpointing.manifest.CheckpointError` naming the bad file.
    """
    path = Path(directory)
    manifest = verify_checkpoint(path, run_id=run_id)
    return read_verified(path, manifest, rank=rank), manifest


def read_verified(path: Path, manifest: Manifest, *, rank: int | None,
                  into: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """``read_state`` after verification (the caller already checked ``manifest`` and the files).

    ``into`` (flat key -> tensor or DTensor) names tensors filled in place instead of fresh ones
    (:func:`~checkpointing.dcp_io.read_tensors`); every one of them must be in the checkpoint."""
    trees = dict(manifest.local_trees)
    wanted = [r for r in sorted(trees) if rank is None or r == rank]
    keys = skeleton_keys(manifest.tree)
    for r in wanted:
        keys += skeleton_keys(trees[r])
    into = dict(into or {})
    unknown = sorted(set(into) - set(keys))
    if unknown:
        raise ValueError(f"checkpoint load: {unknown[0]} is not in the checkpoint of step {manifest.step} "
                         f"({len(unknown)} such entries)")
    keys = [k for k in keys if k not in into]
    tensors = read_tensors(path, keys, {name: e.size for name, e in manifest.files.items()}, into=into)
    state = unflatten_state(manifest.tree, tensors.__getitem__)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: checkpoint root is not a dict")
    if rank is None:
        if wanted:
            state[RANKS_KEY] = {r: unflatten_state(trees[r], tensors.__getitem__) for r in wanted}
    else:
        for r in wanted:
            state.update(unflatten_state(trees[r], tensors.__getitem__))
    return state
