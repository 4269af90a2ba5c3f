"""The commit: turn ``step-N.tmp/`` holding every rank's durable shard into ``step-N/``.

Order (each step durable before the next): merge the ranks' metadata pieces into
``.metadata``; drop files no rank reported (left by an earlier, crashed attempt);
then :func:`commit_directory`: write ``manifest.json``; fsync the directory;
rename it into place; fsync the parent. A crash anywhere before the rename
leaves only a ``.tmp`` directory, which is never loaded; after it, the
checkpoint is complete. Megatron's checkpoints (``checkpointing.megatron_dist``)
end in the same :func:`commit_directory`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from checkpointing import testhooks
from checkpointing.dcp_io import METADATA_FILE, merge_metadata_pieces, metadata_piece_name
from checkpointing.durable import file_sha256, fsync_dir, remove_tree
from checkpointing.manifest import MANIFEST_FILE, FileEntry, Manifest

__all__ = ["TMP_SUFFIX", "commit_checkpoint", "commit_directory", "describe_files"]

TMP_SUFFIX = ".tmp"
_REPLACED_SUFFIX = ".replaced"


def describe_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of the named files (JSON-able, to be sent through the store)."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        size, digest = file_sha256(directory / name)
        out[name] = {"size": size, "sha256": digest}
    return out


def commit_checkpoint(
    tmp_dir: Path,
    final_dir: Path,
    *,
    step: int,
    world_size: int,
    files_by_rank: dict[int, dict[str, dict[str, Any]]],
    tree: dict[str, Any],
    local_trees: dict[int, dict[str, Any]],
    extras: dict[str, Any],
    run_id: str | None,
    rank: int = 0,
) -> Manifest:
    writers = sorted(files_by_rank)
    merge_metadata_pieces(tmp_dir, writers)
    testhooks.crash_point("metadata", step=step, rank=rank)
    files: dict[str, FileEntry] = {}
    for r in writers:
        for name, entry in files_by_rank[r].items():
            if name == metadata_piece_name(r):
                continue
            files[name] = FileEntry(size=int(entry["size"]), sha256=str(entry["sha256"]))
    size, digest = file_sha256(tmp_dir / METADATA_FILE)
    files[METADATA_FILE] = FileEntry(size=size, sha256=digest)
    for stale in tmp_dir.iterdir():
        if stale.name not in files and stale.name != MANIFEST_FILE:
            if stale.is_dir():
                remove_tree(stale)
            else:
                stale.unlink()
    manifest = Manifest(
        step=step,
        world_size=world_size,
        files=files,
        tree=tree,
        local_trees=local_trees,
        extras=extras,
        run_id=run_id,
    )
    commit_directory(tmp_dir, final_dir, manifest,
                     crash_point=lambda stage: testhooks.crash_point(stage, step=step, rank=rank))
    return manifest


def commit_directory(tmp_dir: Path, final_dir: Path, manifest: Manifest, *,
                     crash_point: Callable[[str], None] = lambda stage: None) -> None:
    """Writes ``manifest`` into ``tmp_dir`` (whose files are durable already) and renames it to ``final_dir``,
    atomically: a reader sees the old directory or the complete new one. A step saved again (after a rollback)
    replaces the old one, which is moved aside first and removed once the new one is in place.
    ``crash_point(stage)``: the tests' crash points (``manifest``, ``renamed``)."""
    manifest.write(tmp_dir)
    fsync_dir(tmp_dir)
    crash_point("manifest")
    replaced = None
    if final_dir.exists():
        replaced = final_dir.with_name(final_dir.name + _REPLACED_SUFFIX)
        remove_tree(replaced)
        os.rename(final_dir, replaced)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if replaced is not None:
        remove_tree(replaced)
    crash_point("renamed")
