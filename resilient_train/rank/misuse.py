"""Misuse the runtime can see in a step, stopped with one line (:class:`UsageError`) instead of passing silently.

* **Gradients no reducer averaged.** At a world of more than one, a step whose
  vote goes out without a reduction (the commit gate's own two-element
  all-reduce) while the model holds gradients: nothing averaged them (no
  ``sup.ddp``, no ``ctx.average_gradients()``), so every replica would apply
  its own and they would drift apart, and a heal would copy one replica's
  drifted weights to another. Refused at the first such step. A sharded model
  (``sup.sharded``: FSDP and TP reduce in their own collectives) and DDP
  reducing the plan's buckets itself (NCCL) vote that way by design.
* **A DDP built inside the step.** From every restore until a step reduced
  through a reducer, each DistributedDataParallel's call is looked at (a
  process-wide module pre-hook, removed after that step: nothing per module
  call in steady state). One built in this generation gets the plan's hook
  before its first forward, as one built in ``on_new_group`` does; one of an
  earlier generation, or with a communication hook of its own, is refused
  (:func:`resilient_train.rank.ddp.adopt_ddp`).
* **A batch that is not a function of the step** (:mod:`resilient_train.rank.batch_check`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.hooks import RemovableHandle

from resilient_train.rank.batch_check import BatchFingerprints
from resilient_train.rank.ddp import adopt_ddp
from resilient_train.rank.errors import UsageError
from resilient_train.rank.group import release_in_background
from resilient_train.rank.reducer import GradientReducer
from resilient_train.rank.sharded import ShardedModule
from resilient_train.rank.train_state import TrainState

__all__ = ["MisuseChecks", "UNREDUCED"]

UNREDUCED = ("gradients that no reducer averaged across the {world} ranks would be applied at step {step} "
             "(no sup.ddp model was called and ctx.average_gradients() was not): the replicas would diverge, and "
             "healing would copy diverged weights; wrap the model with sup.ddp(model) and call what it returns, "
             "or call ctx.average_gradients() after backward")


class MisuseChecks:
    """The stepper's checks of how a step uses the runtime (see the module's docstring)."""

    def __init__(self, *, state: TrainState, world_size: int, step: Callable[[], int],
                 generation: Callable[[], int], group: Callable[[], dist.ProcessGroup | None],
                 reducers: Callable[[], list[GradientReducer]],
                 new_reducer: Callable[[Any], GradientReducer], emit: Callable[..., Any], rank: int,
                 training: Callable[[], bool]) -> None:
        self._state, self._world, self._step, self._generation = state, world_size, step, generation
        self._group, self._reducers, self._new_reducer, self._emit, self._rank = group, reducers, new_reducer, emit, rank
        self._sharded = isinstance(state.model, ShardedModule)
        self._watch: RemovableHandle | None = None
        self._held: list[list[dist.ProcessGroup]] = []  # the groups of DDPs adopted in a step (see _adopt)
        self.batches = BatchFingerprints(state.model, rank=rank, emit=emit, training=training)

    # ---------------------------------------------------- unreduced gradients
    def check_unreduced(self) -> None:
        """The vote goes out with no reduction at a world > 1: refused if gradients would be applied unaveraged."""
        if self._sharded or any(r.native for r in self._reducers()):
            return
        if any(p.grad is not None for p in self._state.model.parameters()):
            raise UsageError(UNREDUCED.format(world=self._world, step=self._step()))

    # ---------------------------------------------------- DDP built in a step
    def arm(self) -> None:
        """After a restore: the DDPs called in the next steps are looked at until a step reduced through one."""
        if not self._sharded and self._watch is None:
            self._watch = register_module_forward_pre_hook(self._on_call)

    def _on_call(self, module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, DDP):
            self._adopt(module)

    def _adopt(self, ddp: DDP) -> None:
        generation = self._generation()
        if adopt_ddp(ddp, self._group(), self._new_reducer, generation):
            # The script drops this DDP in a later generation's step, on the main thread: were it the last
            # holder of its group, the group's destructor would join gloo's threads there (see
            # Supervisor._release_group). This reference goes on a daemon thread instead, once it is old.
            self._held.append([ddp.process_group])
            self._emit("ddp_adopted_in_step", rank=self._rank, step=self._step(), generation=generation)

    def begin(self, step: int, data_rank: int) -> None:
        """A computation of ``step`` as ``data_rank`` starts (a step, or a re-run of one)."""
        self.batches.begin(step, data_rank)

    def step_end(self) -> None:
        """A step boundary: the DDP watch ends once a step reduced (or at a world of one, after one step)."""
        if self._watch is not None and (self._world == 1 or any(r.reduced or r.native for r in self._reducers())):
            self._watch.remove()
            self._watch = None
        current = self._group()
        old = [box for box in self._held if box[0] is not current]
        self._held = [box for box in self._held if box[0] is current]
        for box in old:
            release_in_background(box)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        self.batches.close()
        held, self._held = self._held, []
        for box in held:
            release_in_background(box)
