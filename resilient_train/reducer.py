"""The data-parallel gradient reduction, in a fixed layout, with the commit vote riding on it.

All gradients are packed into one flat buffer in a layout that never changes,
across steps and across generations: the parameters in reverse order (the
order their gradients become ready in backward), cut into chunks of about
``chunk_mb`` at parameter boundaries, and one extra element at the very end:
the **vote**. Each chunk is one all-reduce. gloo's result for an element
depends on how its tensor is cut, so a fixed layout gives the same bits in
every generation (a DDP rebuilt after a recovery regroups its buckets and
changes them).

The vote element carries each rank's verdict on the step: 1.0 to commit,
NaN when the rerun validators reject the step, 0.0 to abstain. After the
reduction every rank reads the same sum: ``world_size`` means every rank
contributed its gradients and agreed, so the optimizer may step. The vote
rides in the last chunk, launched only after the rank has published its
rank-local state of the next step boundary (``before_vote``), so a completed
reduction also proves that every rank's next boundary is recoverable.

Two ways in: :meth:`GradientReducer.reduce_all` after backward
(``ctx.average_gradients()``), or as a DDP communication hook
(:meth:`GradientReducer.ddp_hook`), which copies each DDP bucket into the
fixed layout and launches a chunk as soon as all of its parameters arrived,
so communication still overlaps backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["FlatLayout", "GradientReducer", "ReducerHooks"]

DEFAULT_CHUNK_MB = 25.0  # DDP's default bucket size


VOTE_SLOTS = 2  # the vote and the stop flag ride at the end of the last chunk


class FlatLayout:
    """Offsets of each parameter in the flat buffer, and the chunks it is reduced in."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, chunk_mb: float = DEFAULT_CHUNK_MB) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters to reduce")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one dtype expected, got {sorted(map(str, dtypes))}")
        self.dtype = self.params[0].dtype
        if not self.dtype.is_floating_point:
            raise ValueError(f"floating-point parameters expected, got {self.dtype}")
        limit = max(1, int(chunk_mb * 2**20) // self.params[0].element_size())
        self.offsets = [0] * len(self.params)
        self.chunks: list[tuple[int, int]] = []  # [start, end) in elements
        self.chunk_params: list[list[int]] = []
        self.chunk_of = [0] * len(self.params)
        offset, start = 0, 0
        for i in reversed(range(len(self.params))):
            n = self.params[i].numel()
            if offset > start and offset - start + n > limit:
                self.chunks.append((start, offset))
                start = offset
            if not self.chunk_params or len(self.chunks) == len(self.chunk_params):
                self.chunk_params.append([])
            self.offsets[i] = offset
            self.chunk_of[i] = len(self.chunks)
            self.chunk_params[-1].append(i)
            offset += n
        self.vote_index = offset  # the commit vote, summed
        self.stop_index = offset + 1  # the stop flag (a preemption), summed
        self.numel = offset + VOTE_SLOTS
        self.chunks.append((start, self.numel))  # the last chunk ends with the vote and the stop flag
        self.index = {id(p): i for i, p in enumerate(self.params)}

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


@dataclass(frozen=True, kw_only=True)
class ReducerHooks:
    """What the supervisor does around a reduction.

    ``before_chunk(views, last)`` sees the local gradients of a chunk just
    before it is reduced (value faults, the local gradient norm);
    ``vote()`` publishes the next boundary's local state and returns this
    rank's vote; ``stop()`` is its stop flag (a preemption signal seen), summed
    with the others' so that every rank learns it after the same step;
    ``group()`` is the current generation's process group.
    """

    vote: Callable[[], float]
    stop: Callable[[], float] = lambda: 0.0  # 1.0: this rank asks every rank to stop after this step
    group: Callable[[], dist.ProcessGroup | None] = lambda: None
    before_chunk: Callable[[list[torch.Tensor], bool], None] | None = None


class GradientReducer:
    def __init__(self, params: Sequence[torch.nn.Parameter], hooks: ReducerHooks, *,
                 chunk_mb: float = DEFAULT_CHUNK_MB) -> None:
        self.layout = FlatLayout(params, chunk_mb=chunk_mb)
        self.hooks = hooks
        self._flat: torch.Tensor | None = None
        self.reset()

    # ------------------------------------------------------------ per step
    def reset(self) -> None:
        """Forgets the last step's reduction (called at the start of every step)."""
        n = len(self.layout.chunks)
        self._arrived = [0] * n
        self._launched = [False] * n
        self._done: list[torch.futures.Future] | None = None  # one per chunk, made with the buffer's device
        self._world = 1
        self._in_flight: Any = None  # the last gloo work launched (see _reduce_chunk)
        self.reduced = False  # the vote chunk went out this step
        self._solo_vote: float | None = None  # a world of one: the vote never leaves the host
        self._solo_stop = 0.0

    def forget(self) -> None:
        """After a failure: forgets the step and the buffer, which a collective left running may still write."""
        self.reset()
        self._flat = None

    def abort(self, error: Exception) -> None:
        """Fails every chunk of this step not reduced yet, from any thread.

        gloo cannot abort a collective: a rank left in one by peers that went on
        to the next generation would wait in DDP's end of backward until the
        group's timeout. Failing the chunks' futures releases it at once (the
        collective itself ends in gloo's thread when its peers' connections go).
        """
        for fut in self._done or []:
            _settle(fut, error=error)

    def vote_sum(self) -> float:
        """Every rank's vote added up; waits for the reduction (on a GPU, for its kernels)."""
        assert self.reduced, "no reduction this step"
        if self._solo_vote is not None:
            return self._solo_vote
        assert self._flat is not None and self._done is not None
        self._done[-1].wait()
        return float(self._flat[self.layout.vote_index])

    def stop_sum(self) -> float:
        """Every rank's stop flag added up (after :meth:`vote_sum`, which waited for the reduction)."""
        assert self.reduced, "no reduction this step"
        if self._solo_vote is not None:
            return self._solo_stop
        assert self._flat is not None
        return float(self._flat[self.layout.stop_index])

    def _solo(self, grads: list[torch.Tensor]) -> None:
        """A world of one: nothing to reduce or copy; the hooks still see the gradients, the vote is cast."""
        if self.hooks.before_chunk is not None:
            self.hooks.before_chunk(grads, True)
        self._solo_vote = self.hooks.vote()
        self._solo_stop = self.hooks.stop()
        self.reduced = True

    def _world_size(self) -> int:
        return dist.get_world_size(self.hooks.group()) if dist.is_initialized() else 1

    # ----------------------------------------------------------- all at once
    def reduce_all(self) -> None:
        """Averages the parameters' gradients in place across the group (after backward)."""
        L = self.layout
        if self._world_size() == 1:
            for p in L.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._solo([p.grad for p in L.params])  # type: ignore[misc]
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in L.params]
        flat = self._begin(grads[0].device)
        torch._foreach_copy_([L.view(flat, i) for i in range(len(L.params))], [g.view_as(p) for g, p in zip(grads, L.params)])
        self._arrived = [len(ps) for ps in L.chunk_params]
        self._launch_ready(flat)
        assert self._done is not None
        torch.futures.wait_all(self._done)
        for i, p in enumerate(L.params):
            view = L.view(flat, i)
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    # --------------------------------------------------------------- DDP hook
    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Makes this reducer ``ddp``'s communication hook."""
        ddp.register_comm_hook(self, _ddp_hook)

    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        L = self.layout
        buffer = bucket.buffer()
        if self._world_size() == 1:
            self._arrived[0] += len(bucket.parameters())
            if self._arrived[0] == len(L.params):  # the last bucket of the step
                self._solo(list(bucket.gradients()))
            done: torch.futures.Future = torch.futures.Future()
            _settle(done, result=buffer)
            return done
        flat = self._begin(buffer.device)
        indices = [L.index[id(p)] for p in bucket.parameters()]
        mine = [L.view(flat, i) for i in indices]
        theirs = [g.view_as(L.params[i]) for g, i in zip(bucket.gradients(), indices)]
        torch._foreach_copy_(mine, theirs)
        for i in indices:
            self._arrived[L.chunk_of[i]] += 1
        self._launch_ready(flat)
        assert self._done is not None
        waits = [self._done[c] for c in sorted({L.chunk_of[i] for i in indices})]

        def copy_back(_: Any) -> torch.Tensor:
            torch._foreach_copy_(theirs, mine)
            return buffer

        return torch.futures.collect_all(waits).then(copy_back)

    # ------------------------------------------------------------- plumbing
    def _begin(self, device: torch.device) -> torch.Tensor:
        if self._flat is None or self._flat.device != device:
            self._flat = torch.zeros(self.layout.numel, dtype=self.layout.dtype, device=device)
        if self._done is None:
            devices = [device] if device.type == "cuda" else None
            self._done = [torch.futures.Future(devices=devices) for _ in self.layout.chunks]
            self._world = self._world_size()
        return self._flat

    def _launch_ready(self, flat: torch.Tensor) -> None:
        """Launches every chunk whose parameters all arrived; the vote's chunk goes last.

        Chunks go out as they fill, which is the order DDP's buckets arrive in: the
        same on every rank. A chunk's bits do not depend on when it goes out, only
        on its fixed content. The vote goes out once every other chunk has, so it
        is cast with every gradient of the rank at hand.
        """
        L = self.layout
        assert self._done is not None
        vote_chunk = len(L.chunks) - 1
        for c in [*range(vote_chunk), vote_chunk]:
            if self._launched[c] or self._arrived[c] != len(L.chunk_params[c]):
                continue
            last = c == vote_chunk
            if last and not all(self._launched[:vote_chunk]):
                continue
            if self.hooks.before_chunk is not None:
                self.hooks.before_chunk([L.view(flat, i) for i in L.chunk_params[c]], last)
            try:
                if last:
                    flat[L.vote_index] = self.hooks.vote()
                    flat[L.stop_index] = self.hooks.stop()
                    self.reduced = True
                self._reduce_chunk(flat, c, self._done[c])
            except BaseException as e:
                # Whoever waits on a chunk that will never go out (DDP's end of backward does) must see why.
                self.abort(e if isinstance(e, Exception) else RuntimeError(repr(e)))
                raise
            self._launched[c] = True

    def _reduce_chunk(self, flat: torch.Tensor, c: int, done: torch.futures.Future) -> None:
        start, end = self.layout.chunks[c]
        piece = flat[start:end]
        world = self._world
        if world == 1:
            _settle(done, result=[piece])
            return
        grads_end = end - VOTE_SLOTS if end == self.layout.numel else end  # the vote is summed, never averaged

        def finish(f: torch.futures.Future) -> None:
            try:
                f.value()  # raises the reduction's error, if any
            except Exception as e:  # noqa: BLE001  (handed to whoever waits on the chunk)
                _settle(done, error=e)
                return
            flat[start:grads_end].div_(world)
            _settle(done, result=[piece])

        if not piece.is_cuda and self._in_flight is not None:
            # gloo: one reduction in flight at a time. A failed collective cannot be aborted, and a group
            # whose worker threads still run one cannot be torn down: with several in flight, two ranks
            # could each wait in one for the other until the group's timeout. Waiting here raises the
            # first failure in this rank's backward, with nothing left pending.
            self._in_flight.wait()
        work = dist.all_reduce(piece, group=self.hooks.group(), async_op=True)
        self._in_flight = work
        work.get_future().then(finish)


def _settle(fut: torch.futures.Future, *, result: Any = None, error: Exception | None = None) -> None:
    """Completes ``fut`` unless it is already: an abort and a collective's end may race."""
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except RuntimeError:  # completed meanwhile by the other side of the race
        pass


def _ddp_hook(reducer: GradientReducer, bucket: dist.GradBucket) -> torch.futures.Future:
    return reducer._on_bucket(bucket)


# DDP checks the hook's annotations as objects (this module's are strings).
_ddp_hook.__annotations__ = {"reducer": GradientReducer, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}
