"""A rank's side of the width: what it reports when it joins, and the layout it adopts from the plan.

A fixed-width job's rank computes its own logical rank in every generation
and its layout never changes (:meth:`Width.full`); with ``ordered_reduction``
it still averages in logical order (a job resumed on another world size is
then bitwise too). An elastic job's rank (``RT_ELASTIC=1``, set by the agent
for ``--nnodes MIN:MAX``) reports the logical ranks it computed and the steps
each one's local state is published for, and adopts the members and the
assignment of every plan. What an elastic job cannot do yet is refused before
its first step, in one line.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from monitors.events import EventLog
from resilient_train.rank.config import SupervisorConfig
from resilient_train.rank.elastic.width import Width
from resilient_train.protocol.env import WorkerEnv
from resilient_train.rank.errors import UsageError
from resilient_train.rank.generation import ResumePlan
from resilient_train.rank.local_state import LocalSlots

__all__ = ["RankWidth", "seed_rank"]

_SEED_STRIDE = 7919  # rank r's streams start from seed * 7919 + r (as the examples always seeded them)


def seed_rank(seed: int, rank: int) -> None:
    """torch's, Python's and (if imported) NumPy's global RNGs, seeded for ``rank``."""
    value = seed * _SEED_STRIDE + rank
    torch.manual_seed(value)
    random.seed(value)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(value % 2**32)


class RankWidth:
    def __init__(self, env: WorkerEnv, config: SupervisorConfig, events: EventLog | None = None) -> None:
        self.slot = env.rank
        self._events = events
        self.elastic = env.elastic
        self.ordered = config.ordered_reduction if config.ordered_reduction is not None else env.elastic
        self.width = Width.full(env.world_size)
        self._joined = False  # a process that joined no generation yet computed nothing
        self._seed: int | None = None  # sup.seed's: every logical rank's RNG streams are seeded from it

    def seed(self, seed: int) -> None:
        """``sup.seed(seed)``: this process's RNGs for its own rank now, and every logical rank's it computes
        from the same rule when it first does (:meth:`initial`)."""
        self._seed = seed
        seed_rank(seed, self.slot)

    def initial(self, logical: int) -> bool:
        """Puts a logical rank's starting RNG states in place, when the script seeded with ``sup.seed``; False
        when it did not (the logical rank then starts from this process's state)."""
        if self._seed is None:
            return False
        seed_rank(self._seed, logical)
        return True

    def check(self, config: SupervisorConfig, *, sharded: bool) -> None:
        """Refuses, in one line, what an elastic job cannot do."""
        if not self.elastic:
            return
        what = ("sup.sharded (FSDP, TP and HSDP keep shards no other process holds: their width cannot change yet)"
                if sharded else "the rerun state machine" if config.rerun.enabled
                else "host snapshots (snapshot_every)" if config.snapshot_every is not None else None)
        if what is not None:
            raise UsageError(f"an elastic job (--nnodes MIN:MAX) cannot use {what}: run it with a fixed node count "
                             "(--nnodes N), or without it")

    def report(self, slots: LocalSlots) -> dict[str, Any]:
        """What a membership of an elastic job carries: its logical ranks and their published steps."""
        if not self.elastic:
            return {}
        hosted = self.width.hosted(self.slot) if self._joined else []
        return {"hosted": hosted, "logical_steps": {str(x): slots.steps(x) for x in hosted}}

    def adopt(self, plan: ResumePlan) -> Width:
        """The generation's layout, from its plan (a fixed-width job's never changes)."""
        if plan.width is not None:
            before = self.width if self._joined else None
            self.width = Width.from_json(plan.width)
            if self._events is not None and self.slot == min(self.width.members) and self.width != before:
                cause = (plan.cause or {}).get("width") or ("start" if before is None else "recovery")
                self._events.emit("width_changed", generation=plan.generation, cause=cause,
                                  processes_from=before.size if before is not None else None,
                                  processes=self.width.size, width=self.width.width,
                                  members=list(self.width.members),
                                  logical={str(m): self.width.hosted(m) for m in self.width.members})
        self._joined = True
        return self.width
