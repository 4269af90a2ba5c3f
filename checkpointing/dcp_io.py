"""Reading and writing the DCP (torch.distributed.checkpoint) part of a checkpoint.

Each rank writes its own shard with DCP's filesystem writer and no collectives:
``__{rank}_0.distcp`` plus a metadata piece ``__{rank}.metadata``. A tensor
may be a chunk of a larger one (a DTensor's local piece, :mod:`checkpointing.shards`):
it is written with its offsets and the global size. The committer merges the
pieces into the global ``.metadata`` (the chunks of one key into one entry, which
must tile the tensor), so a plain ``dcp.load`` on the committed directory reads
every tensor, into any layout. ``.metadata`` is a pickle, so it is only
ever read through :class:`SafeMetadataUnpickler`, which admits DCP's own metadata
classes and nothing else; tensor data is read by DCP with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
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
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from checkpointing.durable import fsync_dir
from checkpointing.errors import disk_full_error
from checkpointing.manifest import CheckpointError
from checkpointing.shards import Chunk, check_tiling
from resilient_train.base.safefiles import create_exclusive

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


class _ChunkPlanner(DefaultSavePlanner):
    """DCP's save planner, with the keys of ``chunks`` written as chunks of a larger tensor (``SHARD`` items).

    One rank's plan is the whole plan here (no collectives), so DCP's check that the plan covers every
    tensor would fail for a chunk: the commit checks the tiling of the merged chunks instead.
    """

    def __init__(self, chunks: dict[str, Chunk]) -> None:
        super().__init__()
        self._chunks = chunks

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [self._as_chunk(item) if item.index.fqn in self._chunks else item for item in plan.items]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _as_chunk(self, item: WriteItem) -> WriteItem:
        chunk = self._chunks[item.index.fqn]
        assert item.tensor_data is not None
        offsets = torch.Size(chunk.offsets)
        return WriteItem(
            index=dcp_metadata.MetadataIndex(item.index.fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=dcp_metadata.ChunkStorageMetadata(offsets=offsets, sizes=item.tensor_data.size),
                properties=item.tensor_data.properties,
                size=torch.Size(chunk.size),
            ),
        )

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], dcp_metadata.Metadata]:
        global_plan, metadata = create_default_global_save_plan(all_plans)
        metadata = dataclasses.replace(metadata, planner_data=dict(self.mappings))
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    def lookup_object(self, index: dcp_metadata.MetadataIndex) -> Any:
        if index.fqn in self._chunks:
            return self.state_dict[index.fqn]  # the local tensor: its offsets are only in the metadata
        return super().lookup_object(index)


def write_shard(
    directory: Path,
    rank: int,
    tensors: dict[str, torch.Tensor],
    *,
    chunks: dict[str, Chunk] | None = None,
    wrap_stream: Callable[[Any], Any] | None = None,
) -> list[str]:
    """Writes this rank's tensors (fsync'd) into ``directory``; returns the file names written.

    A key in ``chunks`` is a chunk of a larger tensor (its offsets and global size go into the metadata).
    Raises :class:`~checkpointing.errors.DiskFullError` when the filesystem ran out of space.
    """
    chunks = dict(chunks or {})
    for key, chunk in chunks.items():
        if key not in tensors:
            raise ValueError(f"chunk of {key!r}: no such tensor to write")
        chunk.check_holds(key, tuple(tensors[key].shape))
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
            dcp.save(dict(tensors), storage_writer=writer, planner=_ChunkPlanner(chunks) if chunks else None,
                     no_dist=True)
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
    """Merges each rank's metadata piece into ``.metadata`` (fsync'd), then removes the pieces.

    The chunks of one key, from several ranks, become one entry; every tensor's chunks must then tile
    it exactly (``ValueError`` otherwise: a chunk missing, or written twice).
    """
    merged: dcp_metadata.Metadata | None = None
    for rank in ranks:
        md = load_metadata(directory / metadata_piece_name(rank))
        if merged is None:
            merged = md
            merged.planner_data = dict(md.planner_data or {})
            continue
        for key, entry in md.state_dict_metadata.items():
            mine = merged.state_dict_metadata.get(key)
            if mine is None:
                merged.state_dict_metadata[key] = entry
            elif _same_tensor(mine, entry):
                mine.chunks.extend(entry.chunks)  # type: ignore[union-attr]
            else:
                raise ValueError(f"ranks wrote checkpoint key {key!r} twice (not as chunks of one tensor)")
        twice = set(merged.storage_data) & set(md.storage_data)
        if twice:
            index = next(iter(twice))
            raise ValueError(f"ranks wrote the chunk of {index.fqn!r} at {list(index.offset or ())} twice")
        merged.storage_data.update(md.storage_data)
        merged.planner_data.update(md.planner_data or {})
    assert merged is not None
    for key, entry in merged.state_dict_metadata.items():
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            why = check_tiling(key, tuple(entry.size), [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks])
            if why is not None:
                raise ValueError(f"the ranks' chunks do not make up the tensor: {why}")
    merged.storage_data = _renumbered(merged)
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


def _same_tensor(a: Any, b: Any) -> bool:
    return (isinstance(a, dcp_metadata.TensorStorageMetadata) and isinstance(b, dcp_metadata.TensorStorageMetadata)
            and a.size == b.size and a.properties.dtype == b.properties.dtype)


def _renumbered(md: dcp_metadata.Metadata) -> dict[dcp_metadata.MetadataIndex, Any]:
    """The storage entries with their index hints pointing into the merged chunk lists (hints only speed
    up lookups, but a wrong one is a trap for the next reader)."""
    position: dict[tuple[str, tuple[int, ...]], int] = {}
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            for i, c in enumerate(entry.chunks):
                position[(key, tuple(c.offsets))] = i
    out = {}
    for index, info in md.storage_data.items():
        hint = position.get((index.fqn, tuple(index.offset))) if index.offset is not None else None
        out[dcp_metadata.MetadataIndex(index.fqn, index.offset, hint)] = info
    return out


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        md = load_metadata(Path(self.path) / METADATA_FILE)
        if md.storage_meta is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def read_tensors(directory: Path, keys: list[str], files: dict[str, int] | None = None, *,
                 into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Reads the named tensors of a (verified) checkpoint directory into fresh CPU tensors.

    ``into`` (key -> tensor) names tensors to fill in place instead: a whole tensor, or a DTensor of
    any layout, whose local piece gets its part of the stored chunks (only the overlapping ones are read).
    They must have the stored tensor's global shape and dtype; a mismatch is a ``ValueError``.

    ``files`` (name -> size, from the verified manifest) bounds what the metadata may claim: every
    tensor's data must lie in those files and fit in the bytes stored for it, checked before
    anything is allocated (a forged ``.metadata`` must not ask for 2**40 elements), and its chunks
    must tile it (no element left unread).
    """
    md = load_metadata(directory / METADATA_FILE)
    stored = _stored_bytes(directory, md, files)
    into = dict(into or {})
    template: dict[str, torch.Tensor] = {}
    for key in [*keys, *into]:
        entry = md.state_dict_metadata.get(key)
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise CheckpointError(directory, METADATA_FILE, f"no tensor entry for {key!r}")
        size, dtype = _checked_shape(directory, key, entry, stored.get(key, 0))
        why = check_tiling(key, tuple(size), [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks])
        if why is not None:
            raise CheckpointError(directory, METADATA_FILE, f"chunks do not make up the tensor: {why}")
        if key in into:
            target = into[key]
            if list(target.shape) != size or target.dtype != dtype:
                raise ValueError(f"checkpoint load: {key} is {dtype}{size} in the checkpoint, "
                                 f"{target.dtype}{list(target.shape)} here")
        else:
            template[key] = torch.empty(size, dtype=dtype)
    template.update(into)
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

