"""A small supervised training job with one rank made slower from a given step.

The slow rank does its own work (forward and backward) ``--slow-factor`` times
slower: it sleeps for the extra fraction of the time it measured. Each step
also sleeps a fixed amount, standing in for a model big enough to dominate the
noise of 4 ranks sharing 2 cores. Sleeps are the workload, not synchronisation.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import resilient_train as rt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--slow-factor", type=float, default=1.5)
    p.add_argument("--work-s", type=float, default=0.02)
    args = p.parse_args(argv)
    sup = rt.Supervisor(rt.SupervisorConfig(steps=args.steps))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = rt.TrainState(model=model, optimizer=optimizer)

    def train_step(ctx: rt.StepContext) -> torch.Tensor:
        ctx.enter("data")
        g = torch.Generator().manual_seed(ctx.step * 100 + ctx.rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
        ctx.enter("forward")
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        time.sleep(args.work_s / 2)
        ctx.enter("backward")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        time.sleep(args.work_s / 2)
        if ctx.rank == args.slow_rank and ctx.step >= args.slow_from:
            time.sleep((args.slow_factor - 1.0) * (time.perf_counter() - t0))
        ctx.average_gradients()
        ctx.enter("optimizer")
        optimizer.step()
        return loss.detach()

    sup.run(train_step, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
