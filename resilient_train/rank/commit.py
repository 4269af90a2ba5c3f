"""The commit of a step: the optimizer may change the state only once every rank voted for it.

A step's optimizer update is the only moment a rank's replicated state
changes. Before it, a fault leaves the rank exactly at the boundary it
started from (its gradients are thrown away); after it, at the next one. The
gate stands between the two: the optimizer's step pre-hook (or the end of the
step, if the optimizer never stepped) reads the vote that rode in the
gradient reduction (:mod:`resilient_train.rank.reducer`), and lets the update
happen only if every rank contributed and agreed and the generation still
stands. On a GPU reading the vote waits for the reduction's kernels: an NCCL
collective aborted after a peer died yields garbage, and the gate is what
keeps garbage out of the optimizer.

Buffers a forward pass changes (BatchNorm's running statistics) are the one
other state a step changes before its commit: :class:`BufferGuard` keeps a
device copy of those that changed at the last boundary, to put back after a
fault before the commit.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from resilient_train.rank.errors import GenerationFailed
from resilient_train.rank.reducer import GradientReducer

__all__ = ["BufferGuard", "CommitGate", "MicroStepDone", "StepMeasured", "StepRejected"]


class _Flow(BaseException):
    """Control flow out of a user's step: a BaseException, so an ``except Exception`` in it lets it pass."""


class StepRejected(_Flow):
    """A rank's validators rejected the step (the vote was NaN): nobody commits; the rerun flow decides."""


class StepMeasured(_Flow):
    """A computation run only to measure its result (a re-run) reached the gate."""


class MicroStepDone(_Flow):
    """A logical rank's micro-step, not the step's last, reached the gate: its gradients are kept for the
    reduction the last one runs (resilient_train.rank.elastic), and nothing is applied."""


class CommitGate:
    """Decides, once per step, whether the optimizer may apply it.

    ``vote()`` is this rank's vote, computed just before it goes out (the
    supervisor publishes the next boundary's local state first). ``decide``
    maps the reduced vote to: commit (return), :class:`StepRejected`,
    :class:`StepMeasured`, or :class:`GenerationFailed`.
    """

    def __init__(self, *, world_size: int, group: Callable[[], dist.ProcessGroup | None],
                 device: torch.device, vote: Callable[[], float], moved: Callable[[], bool],
                 decide: Callable[[float], None], before_update: Callable[[], None],
                 on_optimizer: Callable[[], None] = lambda: None, stop: Callable[[], float] = lambda: 0.0,
                 unreduced: Callable[[], None] = lambda: None) -> None:
        self.world_size = world_size
        self._group = group
        self._device = device
        self._vote = vote
        self._moved = moved
        self._decide = decide
        self._before_update = before_update
        self._on_optimizer = on_optimizer  # the optimizer phase begins (if the script did not mark it)
        self._stop = stop
        self._unreduced = unreduced  # raises where a world > 1 would commit gradients no reducer averaged
        self.reducers: list[GradientReducer] = []
        self.committed = False
        self.stop_agreed = False  # some rank asked every rank to stop after this step (it rode with the vote)
        self._fallback_used = False
        self._suspended = False
        # A micro-step of a logical rank but the step's last: at the gate its local state is published
        # (``micro_done``) and it ends (MicroStepDone). None: the step's commit.
        self.micro: int | None = None
        self.micro_done: Callable[[int], None] = lambda logical: None

    def begin_step(self) -> None:
        self.committed = False
        for r in self.reducers:
            r.reset()

    def pre_hook(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if self._suspended:
            return
        if self.micro is not None:
            self.commit()  # raises MicroStepDone: this micro-step ends before the optimizer
        if not any(r.reduced for r in self.reducers):
            self.commit()  # no reduction carried the vote (FSDP, TP): it goes out now, before the optimizer phase
        self._on_optimizer()
        self.commit()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The optimizer steps outside training (DCP creating an empty optimizer's state): no vote, no commit."""
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False

    def commit(self) -> None:
        """Returns when the step may be applied; raises otherwise. Idempotent within a step."""
        if self.micro is not None:
            if self._moved():
                raise GenerationFailed("the generation was declared failed while the step ran")
            self.micro_done(self.micro)
            raise MicroStepDone()
        if self.committed:
            return
        reduced = [r for r in self.reducers if r.reduced]
        if reduced:
            totals = [r.vote_sum() for r in reduced]  # on a GPU: waits for the reduction's kernels
            stops = [r.stop_sum() for r in reduced]
        else:
            total, stop = self._fallback_vote()
            totals, stops = [total], [stop]
        if self._moved():
            raise GenerationFailed("the generation was declared failed while the step ran")
        for total in totals:
            if math.isnan(total):
                self._decide(total)  # the rerun flow: raises
            elif total != self.world_size:
                raise GenerationFailed(f"only {total:g} of {self.world_size} ranks voted to commit the step")
        self._decide(totals[0])
        self._before_update()
        self.stop_agreed = self.stop_agreed or any(s > 0 for s in stops)
        self.committed = True

    def agree_stop(self) -> bool:
        """At a generation's first boundary, before its first step: whether some rank asked to stop (a signal
        that came during the step that failed, or during the recovery; a signal to the whole job may have taken
        a DataLoader's workers with it, so the step would fail again). Every rank answers the same: the job
        stops here with its checkpoint. One one-element all-reduce per generation."""
        stop = self._stop()
        if self.world_size > 1:
            t = torch.tensor([stop], dtype=torch.float32, device=self._device)
            dist.all_reduce(t, group=self._group())
            stop = t.item()
        self.stop_agreed = self.stop_agreed or stop > 0
        return self.stop_agreed

    def _fallback_vote(self) -> tuple[float, float]:
        """The vote and stop flag of a step whose gradients did not go through a reducer (one rank, a sharded
        model, DDP reducing the plan itself on NCCL, or a step with no gradients)."""
        if self.world_size > 1 and not any(r.native for r in self.reducers):
            self._unreduced()
        vote, stop = self._vote(), self._stop()
        if self.world_size == 1:
            return vote, stop
        if not self._fallback_used:
            self._fallback_used = True  # a two-element all-reduce per step: the cost of an unknown reduction
        t = torch.tensor([vote, stop], dtype=torch.float32, device=self._device)
        dist.all_reduce(t, group=self._group())
        total, stops = t.tolist()
        return total, stops


class BufferGuard:
    """Puts back the buffers a failed step's forward changed.

    A buffer's version counter tells whether it changed, except where a kernel writes it in place: torch's
    batch_norm updates BatchNorm's running statistics and leaves their version as it was. The buffers of
    norm layers are therefore copied at every boundary (a few floats per channel); the others only when
    their version moved.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._saved: dict[str, tuple[int, torch.Tensor]] = {}
        self._unversioned: set[str] | None = None  # the norm layers' buffers, found at the first mark

    def _norm_buffers(self) -> set[str]:
        if self._unversioned is None:
            self._unversioned = {f"{prefix}.{name}" if prefix else name
                                 for prefix, m in self._module.named_modules()
                                 if isinstance(m, torch.nn.modules.batchnorm._NormBase)
                                 for name, _ in m.named_buffers(recurse=False)}
        return self._unversioned

    def mark(self) -> None:
        """At a step boundary: copies the buffers that changed since the last mark (on their device)."""
        unversioned = self._norm_buffers()
        with torch.no_grad():
            for name, buf in self._module.named_buffers():
                seen = self._saved.get(name)
                if seen is None or seen[1].shape != buf.shape:
                    self._saved[name] = (buf._version, buf.detach().clone())
                elif name in unversioned:
                    seen[1].copy_(buf)
                    self._saved[name] = (buf._version, seen[1])
                elif seen[0] != buf._version:
                    self._saved[name] = (buf._version, buf.detach().clone())

    def restore(self) -> int:
        """After a fault before the commit: buffers changed since the mark get their boundary values back."""
        unversioned = self._norm_buffers()
        restored = 0
        with torch.no_grad():
            for name, buf in self._module.named_buffers():
                seen = self._saved.get(name)
                if seen is None or seen[1].shape != buf.shape:
                    continue
                changed = seen[0] != buf._version or (name in unversioned and not torch.equal(buf, seen[1]))
                if changed:
                    buf.copy_(seen[1])
                    self._saved[name] = (buf._version, seen[1])
                    restored += 1
        return restored
