"""Worker processes for test_ordered_sum.py: a real gloo group averaging logical contributions in order."""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist


def contribution(logical: int, n: int) -> torch.Tensor:
    """Logical rank ``logical``'s contribution: values spread over magnitudes, so that the order of the
    additions shows in the bits."""
    g = torch.Generator().manual_seed(1000 + logical)
    return torch.randn(n, generator=g) * torch.logspace(-6, 6, n)


def ordered_rank(rank: int, port: int, hosted: list[list[int]], n: int, out) -> None:
    from resilient_train.rank.chain import ReductionChain
    from resilient_train.rank.elastic.ordered import OrderedSum

    world = len(hosted)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    layout = OrderedSum(hosted, rank)
    contributions = {x: contribution(x, n) for x in layout.mine}
    target = contributions[layout.mine[-1]].clone()
    others = {x: c for x, c in contributions.items() if x != layout.mine[-1]}
    errors: list[Exception] = []
    chain = ReductionChain(errors.append)
    done = torch.futures.Future()
    chain.ordered(target, done, layout=layout, contributions={**others, layout.mine[-1]: target}, group=None)
    got = done.wait()
    out.send((rank, got.clone(), errors))
    dist.destroy_process_group()


def ordered_run(port: int, hosted: list[list[int]], n: int) -> list[torch.Tensor]:
    """Every group rank's result, for one layout."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=ordered_rank, args=(r, port, hosted, n, send), daemon=True) for r in range(len(hosted))]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        if not recv.poll(120):
            raise TimeoutError("a rank of the ordered sum did not answer in 120 s")
        rank, tensor, errors = recv.recv()
        assert not errors, errors
        results[rank] = tensor
    for p in procs:
        p.join(timeout=30)
    return [results[r] for r in range(len(hosted))]


_ = threading  # the chain's callbacks run on gloo's threads
