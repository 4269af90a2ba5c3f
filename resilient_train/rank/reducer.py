"""The data-parallel gradient reduction: one fixed bucket plan, DDP's own buckets, the commit vote beside them.

**The plan** (:class:`~resilient_train.rank.buckets.BucketPlan`) is made once
from the parameters alone, the same in every generation and on every rank:
one all-reduce per bucket of a fixed plan gives the same bits in every
generation (gloo's result depends on how a tensor is cut), where a DDP left
to itself regroups its buckets after its first iteration, in each generation
again.

**No copy.** ``sup.ddp`` builds DDP so that its buckets are this plan
(:mod:`resilient_train.rank.ddp`): the communication hook then reduces each DDP
bucket's own buffer in place. A DDP whose buckets are not the plan (one a
script built itself) takes the copy path: its gradients are copied into the
plan's buffers and back, with the same collectives, so the bits are the same
either way. ``ctx.average_gradients()`` (no DDP) copies the gradients into the
plan's buffers: the same bits again.

**The vote** rides beside the last bucket: a two-element tensor (the vote,
the stop flag), summed, launched right after the last bucket and only after
the rank published the rank-local state of the next step boundary
(``vote()``). Each rank votes 1.0 to commit, NaN when its rerun validators
reject the step, 0.0 to abstain; ``world_size`` in the sum means every rank
contributed all its gradients and agreed, so the optimizer may step.

On NCCL, with no part looking at the gradients, the DDP reduces the plan's
buckets itself, with no hook (:meth:`GradientReducer.can_go_native`), and the
vote goes out at the commit. At a world of one nothing is reduced or copied,
unless ``force`` asks for the collectives of a larger world anyway (benchmarks
measure that path on one GPU).

**Logical ranks** (an elastic job, :mod:`resilient_train.rank.elastic`): a process
computing several logical ranks runs one micro-step per logical rank; in each
but the last the reducer only keeps the bucket's contribution (``micro`` names
the logical rank: :meth:`stash`), and in the last each bucket is averaged with
:func:`~resilient_train.rank.elastic.ordered.launch_ordered` over every logical
rank's contribution, in logical order: the same bits on any number of
processes (``hooks.layout()``; None: the plain all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from resilient_train.rank.buckets import DEFAULT_BUCKET_MB, BucketPlan
from resilient_train.rank.chain import ReductionChain, settle
from resilient_train.rank.elastic.ordered import OrderedSum

__all__ = ["BucketPlan", "DEFAULT_BUCKET_MB", "GradientReducer", "ReducerHooks"]

@dataclass(frozen=True, kw_only=True)
class ReducerHooks:
    """What the supervisor does around a reduction.

    ``before_chunk(views, last)`` sees the local gradients of a bucket just
    before it is reduced (value faults, the local gradient norm); ``last`` is
    the bucket the vote goes out with. ``vote()`` publishes the next
    boundary's local state and returns this rank's vote; ``stop()`` is its
    stop flag (a preemption signal seen), summed with the others' so that
    every rank learns it after the same step; ``group()`` is the current
    generation's process group.
    """

    vote: Callable[[], float]
    stop: Callable[[], float] = lambda: 0.0  # 1.0: this rank asks every rank to stop after this step
    group: Callable[[], dist.ProcessGroup | None] = lambda: None
    before_chunk: Callable[[list[torch.Tensor], bool], None] | None = None
    layout: Callable[[], OrderedSum | None] = lambda: None  # the generation's logical layout (None: all-reduce)


class GradientReducer:
    def __init__(self, params: Sequence[torch.nn.Parameter], hooks: ReducerHooks, *,
                 bucket_mb: float = DEFAULT_BUCKET_MB, force: bool = False) -> None:
        self.plan = BucketPlan(params, bucket_mb=bucket_mb)
        self.hooks = hooks
        self.force = force  # the collectives of world > 1 even at a world of one
        self._flat: list[torch.Tensor] | None = None  # the copy path's buffers, one per bucket (made on first use)
        self._votes: torch.Tensor | None = None
        self._planned = False  # the registered DDP's buckets are the plan (checked once per bucket)
        self.native = False  # the registered DDP reduces its buckets itself (NCCL): no hook, the gate's vote
        self._checked: dict[int, bool] = {}
        self.copied_buckets = 0  # DDP buckets that took the copy path, all steps together
        self.chain = ReductionChain(self.abort)  # gloo: one collective at a time (resilient_train.rank.chain)
        self.micro: int | None = None  # the logical rank whose contribution is kept, in a micro-step but the last
        self._stash: dict[int, list[torch.Tensor]] = {}  # logical rank -> its contribution, bucket by bucket
        self._stashed: set[int] = set()  # the logical ranks kept this step
        self.reset()

    # ------------------------------------------------------------ per step
    def reset(self) -> None:
        """Forgets the last step's reduction (called at the start of every step)."""
        n = len(self.plan)
        self._targets: list[torch.Tensor | None] = [None] * n
        self._arrived = [0] * n
        self._next = 0  # buckets go out in plan order: the same sequence of collectives on every rank
        self._done: list[torch.futures.Future] | None = None  # one per bucket, then the vote's
        self.chain.new_epoch()
        self._sums: list[float] | None = None
        self._world, self._nccl = 1, False  # the group's, read when the step's first bucket goes out
        self.reduced = False  # the vote went out this step
        self._solo_vote: float | None = None  # a world of one: the vote never leaves the host
        self._solo_stop = 0.0
        self._solo_seen = 0

    def new_round(self) -> None:
        """A step of several micro-steps begins: no logical rank's contribution is kept yet."""
        self._stashed = set()

    def forget(self) -> None:
        """After a failure: forgets the step and the buffers, which a collective left running may still write."""
        self.new_round()
        self.reset()
        self._flat = None
        self._votes = None

    def abort(self, error: Exception) -> None:
        """Fails every bucket of this step not reduced yet, and launches none of them, from any thread.

        gloo cannot abort a collective: a rank left in one by peers that went on
        to the next generation would wait in DDP's end of backward until the
        group's timeout. Failing the buckets' futures releases it at once (the
        collective itself ends in gloo's thread when its peers' connections go).
        """
        self.chain.stop_all()
        for fut in self._done or []:
            settle(fut, error=error)

    def vote_sum(self) -> float:
        """Every rank's vote added up; waits for the reduction (on a GPU, for its kernels)."""
        assert self.reduced, "no reduction this step"
        if self._solo_vote is not None:
            return self._solo_vote
        if self._sums is None:
            assert self._done is not None and self._votes is not None
            self._done[-1].wait()
            self._sums = self._votes.tolist()
        return self._sums[0]

    def stop_sum(self) -> float:
        """Every rank's stop flag added up (after :meth:`vote_sum`, which waited for the reduction)."""
        assert self.reduced, "no reduction this step"
        if self._solo_vote is not None:
            return self._solo_stop
        assert self._sums is not None, "stop_sum before vote_sum"
        return self._sums[1]

    def _solo(self) -> bool:
        layout = self.hooks.layout()
        return not self.force and (layout is None or layout.width == 1) and (
            not dist.is_initialized() or dist.get_world_size(self.hooks.group()) == 1)

    def stash(self, b: int, contribution: torch.Tensor) -> None:
        """Keeps bucket ``b``'s contribution of the logical rank of this micro-step (``micro``), for the last."""
        assert self.micro is not None
        P = self.plan
        keep = self._stash.get(self.micro)
        if keep is None or keep[b].device != contribution.device:
            keep = self._stash[self.micro] = [torch.empty(P.numel[i], dtype=P.order[P.buckets[i][0]].dtype,
                                                          device=contribution.device) for i in range(len(P))]
        keep[b].copy_(contribution.view(-1))
        self._stashed.add(self.micro)

    def _cast_solo(self, grads: list[torch.Tensor]) -> None:
        """A world of one: nothing to reduce or copy; the hooks still see the gradients, the vote is cast."""
        if self.hooks.before_chunk is not None:
            self.hooks.before_chunk(grads, True)
        self._solo_vote = self.hooks.vote()
        self._solo_stop = self.hooks.stop()
        self.reduced = True

    # ----------------------------------------------------------- all at once
    def reduce_all(self) -> None:
        """Averages the parameters' gradients in place across the group (after backward)."""
        P = self.plan
        for p in P.order:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.micro is not None:  # a micro-step but the last: its contribution is kept, nothing goes out
            for b in range(len(P)):
                self.stash(b, torch.cat([p.grad.reshape(-1) for p in P.params(b)]))  # type: ignore[union-attr]
            return
        if self._solo():
            self._cast_solo([p.grad for p in P.order])  # type: ignore[misc]
            return
        flats = self._begin(P.order[0].device, flat=True)
        for b in range(len(P)):
            torch._foreach_copy_(P.views(flats[b], b), [p.grad for p in P.params(b)])  # type: ignore[misc]
            self._arrive(b, flats[b])
        self._launch_ready()
        assert self._done is not None
        torch.futures.wait_all(self._done)
        for b in range(len(P)):
            torch._foreach_copy_([p.grad for p in P.params(b)], P.views(flats[b], b))  # type: ignore[misc]

    # --------------------------------------------------------------- DDP hook
    def can_go_native(self, group: dist.ProcessGroup) -> bool:
        """Whether a DDP with this plan's buckets on ``group`` may reduce them itself, with no hook.

        On NCCL, DDP's own C++ reduction of the plan's buckets gives the bits of
        this reducer's (it multiplies each gradient by 1/world while copying it
        into its bucket, then sums; :meth:`_all_reduce` does the same) without a
        Python call per bucket, and a dead peer's collective is aborted through
        the communicator. The vote then goes out at the commit, after backward
        (the gate's own two-element all-reduce). Not on gloo, whose collectives
        cannot be aborted: the hook's futures are what release a rank left in
        one. Not when a part looks at the gradients before they are reduced.
        """
        return self.hooks.before_chunk is None and dist.get_backend(group) == "nccl"

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel, *, planned: bool = False,
                 native: bool = False) -> None:
        """Makes this reducer ``ddp``'s communication hook.

        ``planned``: ``ddp`` was built with this plan's buckets, final from its
        construction on (:mod:`resilient_train.rank.ddp`), so each bucket is reduced
        in place once it is found to hold the plan's parameters. Any other DDP
        (it regroups its buckets after its first iteration) takes the copy path.
        ``native`` (with ``planned``, where :meth:`can_go_native`): no hook at all.
        """
        self._planned = planned
        self._checked = {}
        self.native = planned and native
        if not self.native:
            ddp.register_comm_hook(self, _ddp_hook)

    def _is_planned(self, bucket: dist.GradBucket) -> bool:
        b = bucket.index()
        known = self._checked.get(b)
        if known is None:
            known = self._checked[b] = self._planned and self.plan.holds(b, bucket.parameters())
        return known

    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        P = self.plan
        buffer = bucket.buffer()
        if self.micro is not None:  # a micro-step but the last: keep the contribution, hand DDP its own back
            self._stash_bucket(bucket)
            done = torch.futures.Future()
            settle(done, result=buffer)
            return done
        if self._solo():
            self._solo_seen += len(bucket.parameters())
            if self._solo_seen == len(P.order):  # the last bucket of the step
                self._cast_solo(list(bucket.gradients()))
            done: torch.futures.Future = torch.futures.Future()
            settle(done, result=buffer)
            return done
        if self._is_planned(bucket):
            b = bucket.index()
            self._begin(buffer.device, flat=False)
            self._arrive(b, buffer)
            self._launch_ready()
            assert self._done is not None
            return self._done[b]
        # The copy path: into the plan's buffers, reduced bucket by bucket as they fill, and back.
        self.copied_buckets += 1
        flats = self._begin(buffer.device, flat=True)
        params, grads = bucket.parameters(), bucket.gradients()
        places = [P.where[id(p)] for p in params]
        mine = [flats[b][o : o + g.numel()] for (b, o), g in zip(places, grads)]
        theirs = [g.view(-1) for g in grads]
        torch._foreach_copy_(mine, theirs)
        for b in sorted({b for b, _ in places}):
            self._arrived[b] += sum(1 for c, _ in places if c == b)
            if self._arrived[b] == len(P.buckets[b]):
                self._targets[b] = flats[b]
        self._launch_ready()
        assert self._done is not None
        waits = [self._done[b] for b in sorted({b for b, _ in places})]

        def copy_back(_: Any) -> torch.Tensor:
            torch._foreach_copy_(theirs, mine)
            return buffer

        return torch.futures.collect_all(waits).then(copy_back)

    def _stash_bucket(self, bucket: dist.GradBucket) -> None:
        """A DDP bucket of a micro-step: its gradients, into the plan's buckets they belong to."""
        if self._is_planned(bucket):
            self.stash(bucket.index(), bucket.buffer())
            return
        P = self.plan
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            b, offset = P.where[id(p)]
            if self.micro not in self._stash or b >= len(self._stash[self.micro]):
                self.stash(b, torch.zeros(P.numel[b], dtype=g.dtype, device=g.device))  # allocates, then filled
            self._stash[self.micro][b][offset:offset + g.numel()].copy_(g.view(-1))  # type: ignore[index]
            self._stashed.add(self.micro)  # type: ignore[arg-type]

    # ------------------------------------------------------------- plumbing
    def _begin(self, device: torch.device, *, flat: bool) -> list[torch.Tensor]:
        P = self.plan
        if flat and (self._flat is None or self._flat[0].device != device):
            self._flat = [torch.zeros(P.numel[b], dtype=P.order[P.buckets[b][0]].dtype, device=device)
                          for b in range(len(P))]
        if self._votes is None or self._votes.device != device:
            self._votes = torch.zeros(2, dtype=torch.float32, device=device)
        if self._done is None:
            devices = [device] if device.type == "cuda" else None
            self._done = [torch.futures.Future(devices=devices) for _ in range(len(P) + 1)]
            group = self.hooks.group()
            self._world = dist.get_world_size(group)
            self._nccl = dist.get_backend(group) == "nccl"
        return self._flat if flat else []  # type: ignore[return-value]

    def _arrive(self, b: int, target: torch.Tensor) -> None:
        self._targets[b] = target
        self._arrived[b] = len(self.plan.buckets[b])

    def _launch_ready(self) -> None:
        """Launches, in plan order, every bucket whose gradients are all in; the vote after the last."""
        P = self.plan
        assert self._done is not None
        last = len(P) - 1
        while self._next <= last and self._targets[self._next] is not None:
            b = self._next
            target = self._targets[b]
            assert target is not None
            try:
                if self.hooks.before_chunk is not None:
                    self.hooks.before_chunk(P.views(target, b), b == last)
                self._all_reduce(target, self._done[b], average=True, bucket=b)
                if b == last:
                    self._cast_vote()
            except BaseException as e:
                # Whoever waits on a bucket that will never go out (DDP's end of backward does) must see why.
                self.abort(e if isinstance(e, Exception) else RuntimeError(repr(e)))
                raise
            self._next += 1

    def _cast_vote(self) -> None:
        """The vote and the stop flag, summed across the group right after the last bucket."""
        assert self._votes is not None and self._done is not None
        vote, stop = self.hooks.vote(), self.hooks.stop()  # vote() publishes the next boundary first
        self._votes[0].fill_(vote)  # a fill on the device, no host synchronisation
        self._votes[1].fill_(stop)
        self.reduced = True
        self._all_reduce(self._votes, self._done[-1], average=False)

    def _all_reduce(self, tensor: torch.Tensor, done: torch.futures.Future, *, average: bool,
                    bucket: int | None = None) -> None:
        """Sums ``tensor`` across the group (averaged if ``average``); ``done`` gets it, or the error. A
        bucket of a job with a logical layout is averaged over the logical ranks, in their order, instead.
        On gloo every reduction goes through the chain, one at a time (resilient_train.rank.chain)."""
        group, world = self.hooks.group(), self._world
        layout = self.hooks.layout() if bucket is not None else None
        if layout is not None:
            assert bucket is not None
            contributions = {x: self._stash[x][bucket] for x in self._stashed}
            contributions[next(x for x in layout.mine if x not in self._stashed)] = tensor
            self.chain.ordered(tensor, done, layout=layout, contributions=contributions, group=group)
            return
        if self._nccl:
            if average:
                tensor.mul_(1.0 / world)  # as DDP's own reduction does: the same bits with or without the hook
            work = dist.all_reduce(tensor, group=group, async_op=True)
            work.get_future().then(lambda f: _complete(f, tensor, done))
            return
        self.chain.sum(tensor, done, divide_by=world if average else 1, group=group)


def _complete(f: torch.futures.Future, tensor: torch.Tensor, done: torch.futures.Future) -> None:
    try:
        f.value()
    except Exception as e:  # noqa: BLE001  (handed to whoever waits on the bucket)
        settle(done, error=e)
        return
    settle(done, result=tensor)


def _ddp_hook(reducer: GradientReducer, bucket: dist.GradBucket) -> torch.futures.Future:
    return reducer._on_bucket(bucket)


# DDP checks the hook's annotations as objects (this module's are strings).
_ddp_hook.__annotations__ = {"reducer": GradientReducer, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}
