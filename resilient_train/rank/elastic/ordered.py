"""A sum of W logical contributions in logical order 0..W-1, whatever the processes that hold them.

One flat tensor (a gradient bucket) has one contribution per logical rank;
each process holds those of the logical ranks it computes. The tensor is cut
into one chunk per process (the chunk of group rank c is its ``c``-th of
``P`` near-equal pieces). An all-to-all sends each contribution's chunk ``c``
to group rank ``c``; there the W contributions are added in logical order,
``((x0 + x1) + x2) + ...``, and divided by W; an all-gather returns every
chunk to every process. The additions are the same, in the same order, on any
number of processes and any assignment: the bits of the average depend on the
contributions alone. The bytes each process sends equal a ring all-reduce's:
its contributions less its own chunk, then its chunk to each peer.

:class:`OrderedSum` does the cutting, the packing and the ordered addition;
the collectives are the caller's (the reducer's chain launches them one at a
time: :mod:`resilient_train.rank.reducer`).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

__all__ = ["OrderedSum", "launch_ordered"]


class OrderedSum:
    """The layout of one generation: ``hosted[g]`` is the logical ranks group rank ``g`` computes (sorted)."""

    def __init__(self, hosted: Sequence[Sequence[int]], me: int) -> None:
        self.hosted = [sorted(h) for h in hosted]
        self.size = len(self.hosted)
        self.me = me
        self.width = sum(len(h) for h in self.hosted)
        assert sorted(x for h in self.hosted for x in h) == list(range(self.width)), self.hosted
        self.mine = self.hosted[me]

    def bounds(self, n: int) -> list[tuple[int, int]]:
        """The chunk of each group rank in a tensor of ``n`` elements: ``[start, end)``."""
        return [(n * c // self.size, n * (c + 1) // self.size) for c in range(self.size)]

    def pack(self, contributions: Mapping[int, torch.Tensor], n: int) -> tuple[torch.Tensor, list[int], list[int]]:
        """What this rank sends (its contributions' chunks, owner by owner), the input splits and the output
        splits of the all-to-all."""
        bounds = self.bounds(n)
        parts = [contributions[x][s:e] for s, e in bounds for x in self.mine]
        send = torch.cat(parts) if parts else next(iter(contributions.values())).new_empty(0)
        mine_start, mine_end = bounds[self.me]
        ins = [len(self.mine) * (e - s) for s, e in bounds]
        outs = [len(h) * (mine_end - mine_start) for h in self.hosted]
        return send, ins, outs

    def add(self, received: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's chunk of the average: the received contributions added in logical order, over W."""
        s, e = self.bounds(n)[self.me]
        size = e - s
        pieces: dict[int, torch.Tensor] = {}
        offset = 0
        for logicals in self.hosted:
            for x in logicals:
                pieces[x] = received[offset:offset + size]
                offset += size
        acc = pieces[0].clone()
        for x in range(1, self.width):
            acc.add_(pieces[x])
        return acc.div_(self.width)

    def gather_buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The all-gather's output: one padded piece per group rank (the chunks differ by one element at most)."""
        longest = max(e - s for s, e in self.bounds(n))
        out = like.new_empty(self.size * longest)
        return out, list(out.split(longest))

    def unpack(self, pieces: Sequence[torch.Tensor], n: int, into: torch.Tensor) -> None:
        """Every chunk of the average, from the all-gather's pieces, into ``into`` (``n`` elements)."""
        for (s, e), piece in zip(self.bounds(n), pieces):
            into[s:e].copy_(piece[: e - s])

    def padded(self, chunk: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's chunk, padded to the all-gather's piece size."""
        longest = max(e - s for s, e in self.bounds(n))
        if chunk.numel() == longest:
            return chunk
        out = chunk.new_zeros(longest)
        out[: chunk.numel()].copy_(chunk)
        return out

    def local(self, contributions: Mapping[int, torch.Tensor], into: torch.Tensor) -> None:
        """A world of one process: the ordered sum and the division, with no collective."""
        acc = contributions[0].clone()
        for x in range(1, self.width):
            acc.add_(contributions[x])
        into.copy_(acc.div_(self.width))


def launch_ordered(layout: OrderedSum, contributions: Mapping[int, torch.Tensor], target: torch.Tensor,
                   group: object, finished: Callable[[BaseException | None], None]) -> None:
    """The ordered average of ``contributions`` into ``target``, asynchronously: an all-to-all, the ordered
    addition (on the thread that saw the all-to-all end), an all-gather; then ``finished(error or None)``.

    A world of one process adds locally and calls ``finished`` at once. Raises what launching the first
    collective raises (the caller hands it to whoever waits)."""
    import torch.distributed as dist

    n = target.numel()
    flat = {x: c.reshape(-1) for x, c in contributions.items()}
    if layout.size == 1:
        layout.local(flat, target.view(-1))
        finished(None)
        return
    send, ins, outs = layout.pack(flat, n)
    received = send.new_empty(sum(outs))
    work = dist.all_to_all_single(received, send, output_split_sizes=outs, input_split_sizes=ins, group=group,
                                  async_op=True)

    def gathered(f: torch.futures.Future, pieces: list[torch.Tensor]) -> None:
        try:
            f.value()
            layout.unpack(pieces, n, target.view(-1))
        except BaseException as e:  # noqa: BLE001  (handed to whoever waits on the bucket)
            finished(e)
            return
        finished(None)

    def exchanged(f: torch.futures.Future) -> None:
        try:
            f.value()
            chunk = layout.add(received, n)
            _, pieces = layout.gather_buffers(n, chunk)
            w = dist.all_gather(pieces, layout.padded(chunk, n), group=group, async_op=True)
        except BaseException as e:  # noqa: BLE001
            finished(e)
            return
        w.get_future().then(lambda g: gathered(g, pieces))

    work.get_future().then(exchanged)
