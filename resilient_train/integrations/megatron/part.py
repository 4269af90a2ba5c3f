"""The supervisor part that carries Megatron's parallel state across generations."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from resilient_train.integrations.megatron.parallel import MegatronParallel
from resilient_train.rank.parts import Part

__all__ = ["MegatronPart"]


class MegatronPart(Part):
    """Rebuilds ``parallel_state`` after each new default group; tears it down before the group goes.

    ``emit`` gets one ``megatron_groups`` event per generation (the census:
    groups registered with torch, the integration's groups still alive,
    module attributes re-pointed, Megatron globals left stale) and one
    ``megatron_groups_leaked`` when a teardown leaves any of its groups alive.
    """

    def __init__(self, parallel: MegatronParallel, *, device: torch.device, emit: Callable[..., None]) -> None:
        self.parallel = parallel
        self._abort = device.type == "cuda"
        self._emit = emit

    def on_generation(self, generation: int, store: dist.Store) -> None:
        self.parallel.build(generation)
        c = self.parallel.count()
        self._emit("megatron_groups", rank=self.parallel.rank, generation=generation, registered=c.registered,
                   alive=c.alive, built=c.built, repointed=self.parallel.repointed, stale=self.parallel.stale)

    def before_release(self) -> None:
        generation = self.parallel.generation
        c = self.parallel.teardown(abort=self._abort)
        if c.alive:
            self._emit("megatron_groups_leaked", rank=self.parallel.rank, generation=generation, alive=c.alive,
                       holders=self.parallel.census.holders())

    def close(self) -> None:
        self.parallel.teardown(abort=self._abort)
