"""The parallel layout as data: a device mesh's shape, and which of its dimensions replicate the state.

A :class:`MeshSpec` names the mesh a script parallelises on (``fully_shard``,
``parallelize_module``). Each generation builds a new ``DeviceMesh`` from it on
that generation's process group (a mesh holds its groups: one from a failed
generation is finished). The spec also says what each rank holds: ranks with
the same coordinates on every dimension that is *not* a replicate dimension
hold the same shards (a **replica class**), so a lost rank heals from another
member of its class (HSDP's other replica group, TP×DP's DP peer), and a class
of one (pure FSDP, pure TP) is covered by a buddy copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from resilient_train.rank.errors import UsageError

__all__ = ["MeshSpec", "build_mesh", "release_mesh"]


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """``shape`` of the mesh (one ``-1`` stands for what the world size leaves), its dimension ``names``,
    and the ``replicate`` dimensions: along those every rank holds the same state.

    FSDP on every rank: ``MeshSpec(shape=(-1,), names=("shard",))``. HSDP:
    ``MeshSpec(shape=(2, -1), names=("replicate", "shard"), replicate=("replicate",))``.
    TP × DP: ``MeshSpec(shape=(-1, 2), names=("dp", "tp"), replicate=("dp",))``.
    """

    shape: tuple[int, ...] = (-1,)
    names: tuple[str, ...] = ("shard",)
    replicate: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.names) or not self.shape:
            raise UsageError(f"MeshSpec: shape {self.shape} and names {self.names} must have the same length")
        if len(set(self.names)) != len(self.names):
            raise UsageError(f"MeshSpec: dimension names must differ, got {self.names}")
        if sum(1 for s in self.shape if s == -1) > 1 or any(s == 0 or s < -1 for s in self.shape):
            raise UsageError(f"MeshSpec: sizes must be >= 1, with at most one -1, got {self.shape}")
        unknown = set(self.replicate) - set(self.names)
        if unknown:
            raise UsageError(f"MeshSpec: replicate names {sorted(unknown)} are not dimensions of {self.names}")

    def sizes(self, world_size: int) -> tuple[int, ...]:
        known = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if world_size % known:
                raise UsageError(f"MeshSpec {self.shape}: {world_size} ranks do not divide into it")
            return tuple(world_size // known if s == -1 else s for s in self.shape)
        if known != world_size:
            raise UsageError(f"MeshSpec {self.shape} holds {known} ranks, the job has {world_size}")
        return self.shape

    def coordinates(self, rank: int, world_size: int) -> tuple[int, ...]:
        """``rank``'s coordinates (the mesh is ``arange(world_size)`` in the spec's shape, row-major)."""
        sizes = self.sizes(world_size)
        coords = []
        for size in reversed(sizes):
            rank, c = divmod(rank, size)
            coords.append(c)
        return tuple(reversed(coords))

    def replica_class(self, rank: int, world_size: int) -> int:
        """Ranks with the same class hold the same shards: their coordinates off the replicate dimensions."""
        sizes = self.sizes(world_size)
        coords = self.coordinates(rank, world_size)
        cls = 0
        for name, size, c in zip(self.names, sizes, coords):
            if name not in self.replicate:
                cls = cls * size + c
        return cls

    def first_replica(self, rank: int, world_size: int) -> bool:
        """The member of its replica class that writes the class's shards to disk: at 0 on every replicate
        dimension (the others hold the same shards)."""
        sizes = self.sizes(world_size)
        coords = self.coordinates(rank, world_size)
        return all(c == 0 for name, size, c in zip(self.names, sizes, coords) if name in self.replicate)


def build_mesh(spec: MeshSpec, *, world_size: int, device: torch.device) -> DeviceMesh:
    """The mesh on the current default process group (the generation's); sub-groups are made on it."""
    return init_device_mesh(device.type, spec.sizes(world_size), mesh_dim_names=spec.names)


def release_mesh(mesh: DeviceMesh | None) -> None:
    """Forgets the process groups a mesh of a failed generation holds.

    A DTensor keeps its mesh, and the mesh keeps its groups in a registry: an
    optimizer state still holding a DTensor of the failed generation would keep
    that group's gloo connections open, and a peer blocked in a collective with
    this rank would wait for the whole group timeout instead of failing at once.
    """
    if mesh is None:
        return
    for m in {id(m): m for m in (mesh, getattr(mesh, "_root_mesh", None)) if m is not None}.values():
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
