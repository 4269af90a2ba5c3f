"""Reading and writing the DCP (torch.distributed.checkpoint) part of a checkpoint.

Each rank writes its own shard with DCP's filesystem writer and no collectives:
``__{rank}_0.distcp`` plus a metadata piece ``__{rank}.metadata``. The committer
merges the pieces into the global ``.metadata``, so a plain ``dcp.load`` on the
committed directory reads every tensor. ``.metadata`` is a pickle, so it is only
ever read through :class:`SafeMetadataUnpickler`, which admits DCP's own metadata
classes and nothing else; tensor data is read by DCP with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

from checkpointing.durable import fsync_dir
from checkpointing.errors import disk_full_error
from checkpointing.manifest import CheckpointError
from monitors.safefiles import create_exclusive

__all__ = [
    "METADATA_FILE",
    "SafeMetadataUnpickler",
    "UnsafeMetadataError",
    "load_metadata",
    "merge_metadata_pieces",
    "metadata_piece_name",
    "read_tensors",
    "write_shard",
]

METADATA_FILE = ".metadata"

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict"}),
}


class UnsafeMetadataError(pickle.UnpicklingError):
    """A ``.metadata`` file referred to something other than DCP's metadata types."""


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: DCP metadata classes, ``torch.Size``, dtypes, containers."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeMetadataError(f"refused to load {module}.{name} from checkpoint metadata")


def load_metadata(path: Path) -> dcp_metadata.Metadata:
    """Reads DCP metadata through the restricted unpickler; raises :class:`CheckpointError` naming the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            md = SafeMetadataUnpickler(io.BytesIO(f.read())).load()
    except FileNotFoundError:
        raise CheckpointError(path.parent, path.name, "missing") from None
    except Exception as e:  # any unpickling failure means the file is not DCP metadata
        raise CheckpointError(path.parent, path.name, f"unreadable DCP metadata: {e}") from None
    if not isinstance(md, dcp_metadata.Metadata):
        raise CheckpointError(path.parent, path.name, f"does not hold DCP metadata (got {type(md).__name__})")
    return md


def metadata_piece_name(rank: int) -> str:
    return f"__{rank}{METADATA_FILE}"


class _RankWriter(FileSystemWriter):
    """DCP's filesystem writer pinned to one rank's file names, without collectives."""

    def __init__(self, path: Path, rank: int, wrap_stream: Callable[[Any], Any] | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self._rank = rank
        if wrap_stream is not None:
            original = self.fs.create_stream

            import contextlib

            @contextlib.contextmanager
            def create_stream(p: Any, mode: str) -> Any:
                with original(p, mode) as stream:
                    yield wrap_stream(stream)

            self.fs.create_stream = create_stream  # type: ignore[method-assign]

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, rank=self._rank, use_collectives=False)


def write_shard(
    directory: Path,
    rank: int,
    tensors: dict[str, torch.Tensor],
    *,
    wrap_stream: Callable[[Any], Any] | None = None,
) -> list[str]:
    """Writes this rank's tensors (fsync'd) into ``directory``; returns the file names written.

    Raises :class:`~checkpointing.errors.DiskFullError` when the filesystem ran out of space.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name in (f"__{rank}_0.distcp", metadata_piece_name(rank)):
        # DCP opens its files by name and follows links: a link left where this rank writes would
        # have the shard written over the link's target.
        if (directory / name).is_symlink():
            (directory / name).unlink()
    writer = _RankWriter(directory, rank, wrap_stream)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(dict(tensors), storage_writer=writer, no_dist=True)
    except CheckpointException as e:  # a BaseException in DCP: turn it into an ordinary error
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        full = disk_full_error(directory, e, needed=needed, what=f"writing the shard of rank {rank}")
        if full is not None:
            raise full from None
        raise OSError(f"writing the shard of rank {rank} failed: {_last_line(e)}") from None
    piece = metadata_piece_name(rank)
    md = load_metadata(directory / piece)
    files = sorted({info.relative_path for info in md.storage_data.values()})
    return files + [piece]


def merge_metadata_pieces(directory: Path, ranks: list[int]) -> None:
    """Merges each rank's metadata piece into ``.metadata`` (fsync'd), then removes the pieces."""
    merged: dcp_metadata.Metadata | None = None
    for rank in ranks:
        md = load_metadata(directory / metadata_piece_name(rank))
        if merged is None:
            merged = md
            merged.planner_data = dict(md.planner_data or {})
            continue
        overlap = set(merged.state_dict_metadata) & set(md.state_dict_metadata)
        if overlap:
            raise ValueError(f"ranks wrote the same checkpoint keys twice: {sorted(overlap)[:3]}")
        merged.state_dict_metadata.update(md.state_dict_metadata)
        merged.storage_data.update(md.storage_data)
        merged.planner_data.update(md.planner_data or {})
    assert merged is not None
    if merged.storage_meta is not None:
        merged.storage_meta.checkpoint_id = None
    tmp = directory / (METADATA_FILE + ".tmp")
    fd = create_exclusive(tmp)
    with os.fdopen(fd, "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / METADATA_FILE)
    for rank in ranks:
        (directory / metadata_piece_name(rank)).unlink()
    fsync_dir(directory)


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        md = load_metadata(Path(self.path) / METADATA_FILE)
        if md.storage_meta is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def read_tensors(directory: Path, keys: list[str], files: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Reads the named tensors of a (verified) checkpoint directory into fresh CPU tensors.

    ``files`` (name -> size, from the verified manifest) bounds what the metadata may claim: every
    tensor's data must lie in those files and fit in the bytes stored for it, checked before
    anything is allocated (a forged ``.metadata`` must not ask for 2**40 elements).
    """
    md = load_metadata(directory / METADATA_FILE)
    stored = _stored_bytes(directory, md, files)
    template: dict[str, torch.Tensor] = {}
    for key in keys:
        entry = md.state_dict_metadata.get(key)
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise CheckpointError(directory, METADATA_FILE, f"no tensor entry for {key!r}")
        size, dtype = _checked_shape(directory, key, entry, stored.get(key, 0))
        template[key] = torch.empty(size, dtype=dtype)
    if template:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(template, storage_reader=_SafeReader(directory), no_dist=True)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise CheckpointError(directory, None, f"tensor data unreadable: {_last_line(e)}") from None
    return template


_MAX_DIMS = 64


def _stored_bytes(directory: Path, md: dcp_metadata.Metadata, files: dict[str, int] | None) -> dict[str, int]:
    """Bytes stored per tensor key; every storage item must lie inside a listed file."""
    out: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name, offset, length = getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or not isinstance(offset, int) or not isinstance(length, int):
            raise CheckpointError(directory, METADATA_FILE, f"malformed storage entry for {getattr(index, 'fqn', '?')!r}")
        if files is not None:
            if name not in files:
                raise CheckpointError(directory, METADATA_FILE, f"refers to {name!r}, which the manifest does not list")
            if offset < 0 or length < 0 or offset + length > files[name]:
                raise CheckpointError(directory, METADATA_FILE, f"storage entry {offset}+{length} lies outside {name!r}")
        fqn = getattr(index, "fqn", None)
        if isinstance(fqn, str):
            out[fqn] = out.get(fqn, 0) + length
    return out


def _checked_shape(
    directory: Path, key: str, entry: dcp_metadata.TensorStorageMetadata, stored: int
) -> tuple[list[int], torch.dtype]:
    size, dtype = entry.size, getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(directory, METADATA_FILE, f"{key!r}: not a tensor dtype: {dtype!r}")
    dims = list(size) if isinstance(size, (tuple, list)) else None
    if dims is None or len(dims) > _MAX_DIMS or not all(isinstance(d, int) and d >= 0 for d in dims):
        raise CheckpointError(directory, METADATA_FILE, f"{key!r}: malformed shape {size!r}")
    numel = 1
    for d in dims:
        numel *= d
    nbytes = numel * dtype.itemsize
    if nbytes > stored:
        raise CheckpointError(directory, METADATA_FILE, f"{key!r}: shape {dims} needs {nbytes} bytes, "
                              f"{stored} are stored for it")
    return dims, dtype


def _last_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    for ln in reversed(lines):  # DCP's messages end with the original error after a traceback
        if "Error" in ln or "error" in ln:
            return ln.strip()
    return lines[-1].strip() if lines else type(e).__name__

