"""Megatron's parallel layout as data: which coordinates a rank has, and who holds the same shard.

A pure function of the parallel sizes (no megatron import, no process
group): Megatron numbers ranks by an order string, ``tp-cp-ep-dp-pp`` by
default, the first name varying fastest. Tensor- and pipeline-parallel
coordinates decide which slice of the model a rank holds; data- and
context-parallel ranks hold the same weights. With the distributed optimizer,
the optimizer state is also sharded over the data-and-context-parallel group
(within each of ``optimizer_instances`` instances), so a replica must also sit
at the same place inside its instance.

A rank that lost its state heals from a rank of the same shard in another
replica (:meth:`ParallelLayout.heal_sources`); a shard with no surviving
holder cannot be healed from a peer (the disk checkpoint covers it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["Coords", "HealAssignment", "ParallelLayout"]

_NAMES = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True, kw_only=True)
class Coords:
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True, kw_only=True)
class HealAssignment:
    sources: dict[int, int] = field(default_factory=dict)  # target rank -> the rank it copies its shard from
    uncovered: list[int] = field(default_factory=list)  # targets whose shard no holder has


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The sizes ``initialize_model_parallel`` is given, and the world they divide."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    order: str = "tp-cp-ep-dp-pp"
    distributed_optimizer: bool = False
    optimizer_instances: int = 1  # Megatron's num_distributed_optimizer_instances

    def __post_init__(self) -> None:
        for name in ("world_size", "tensor", "pipeline", "context", "expert", "optimizer_instances"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelLayout.{name} must be an integer >= 1, got {v!r}")
        tokens = self.order.lower().split("-")
        if sorted(tokens) != sorted(_NAMES):
            raise ValueError(f"ParallelLayout.order must name each of {'-'.join(_NAMES)} once, got {self.order!r}")
        model = self.tensor * self.pipeline * self.context
        if self.world_size % model:
            raise ValueError(f"world size {self.world_size} is not divisible by tensor x pipeline x context = {model}")
        if (self.data * self.context) % self.optimizer_instances:
            raise ValueError(f"data x context = {self.data * self.context} is not divisible by "
                             f"optimizer_instances = {self.optimizer_instances}")
        if self.expert > 1:
            # Expert layers split the data-parallel dimension again: their shards have other replicas.
            raise ValueError("ParallelLayout: expert parallelism (expert > 1) is not supported yet")

    @property
    def data(self) -> int:
        return self.world_size // (self.tensor * self.pipeline * self.context)

    @property
    def model_parallel(self) -> bool:
        """True when ranks hold different slices of the model (tensor or pipeline parallel)."""
        return self.tensor > 1 or self.pipeline > 1

    def _sizes(self) -> dict[str, int]:
        # The dense part's generator: experts ride inside the data-parallel dimension.
        return {"tp": self.tensor, "cp": self.context, "ep": 1, "dp": self.data, "pp": self.pipeline}

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        sizes, out, rest = self._sizes(), {}, rank
        for name in self.order.lower().split("-"):
            out[name] = rest % sizes[name]
            rest //= sizes[name]
        return Coords(tp=out["tp"], cp=out["cp"], dp=out["dp"], pp=out["pp"])

    def rank_of(self, coords: Coords) -> int:
        sizes, rank, stride = self._sizes(), 0, 1
        values = {"tp": coords.tp, "cp": coords.cp, "ep": 0, "dp": coords.dp, "pp": coords.pp}
        for name in self.order.lower().split("-"):
            rank += values[name] * stride
            stride *= sizes[name]
        return rank

    def groups(self, kind: str) -> list[list[int]]:
        """The rank groups of one kind, named as Megatron's rank generator names them (``tp``, ``dp-cp``,
        ``tp-pp``, ...), each in Megatron's order."""
        varying = tuple(kind.lower().split("-"))
        if not varying or not set(varying) <= {"tp", "cp", "dp", "pp"}:
            raise ValueError(f"unknown group kind {kind!r}")
        by_key: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(getattr(c, n) for n in ("tp", "cp", "dp", "pp") if n not in varying)
            by_key.setdefault(key, []).append(r)
        return sorted((sorted(g, key=lambda r: self._index_in(r, varying)) for g in by_key.values()),
                      key=lambda g: g[0])

    def _index_in(self, rank: int, varying: tuple[str, ...]) -> int:
        """A rank's position in its group, as Megatron counts it: the order string's names, first fastest."""
        c, sizes = self.coords(rank), self._sizes()
        index, stride = 0, 1
        for name in self.order.lower().split("-"):
            if name in varying:
                index += getattr(c, name) * stride
                stride *= sizes[name]
        return index

    def position(self, rank: int, kind: str) -> tuple[int, int]:
        """``rank``'s index in its group of ``kind``, and the group's size."""
        varying = tuple(kind.lower().split("-"))
        sizes = self._sizes()
        size = 1
        for name in varying:
            size *= sizes[name]
        return self._index_in(rank, varying), size

    def shard_of(self, rank: int) -> tuple[int, ...]:
        """What a rank holds: equal for two ranks exactly when one can heal the other."""
        c = self.coords(rank)
        key: tuple[int, ...] = (c.tp, c.pp)
        if self.distributed_optimizer:
            per_instance = (self.data * self.context) // self.optimizer_instances
            key += (self._index_in(rank, ("cp", "dp")) % per_instance,)
        return key

    def replicas(self, rank: int) -> list[int]:
        """The other ranks that hold the same shard as ``rank``."""
        mine = self.shard_of(rank)
        return [r for r in range(self.world_size) if r != rank and self.shard_of(r) == mine]

    def heal_sources(self, targets: Iterable[int], holders: Iterable[int]) -> HealAssignment:
        """Each target gets a holder of its own shard; targets of one shard are spread over its holders."""
        by_shard: dict[tuple[int, ...], list[int]] = {}
        for h in sorted(set(holders)):
            by_shard.setdefault(self.shard_of(h), []).append(h)
        used: dict[tuple[int, ...], int] = {}
        sources, uncovered = {}, []
        for t in sorted(set(targets)):
            shard = self.shard_of(t)
            candidates = [h for h in by_shard.get(shard, []) if h != t]
            if not candidates:
                uncovered.append(t)
                continue
            k = used.get(shard, 0)
            sources[t] = candidates[k % len(candidates)]
            used[shard] = k + 1
        return HealAssignment(sources=sources, uncovered=uncovered)
