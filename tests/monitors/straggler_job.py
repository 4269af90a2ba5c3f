"""A small supervised training job with one rank made slower from a given step.

The slow rank does its own work (forward and backward) ``--slow-factor`` times
slower: it sleeps for the extra fraction of the time it measured. Each step
also sleeps a fixed amount, standing in for a model big enough to dominate the
noise of 4 ranks sharing 2 cores. Sleeps are the workload, not synchronisation.

With ``--gpu-work``, the workload is a GPU kernel that spins for ``--work-s``
(``--slow-factor`` times longer on the slow rank) and is only queued by the
forward pass: the CPU does not wait for it until the NCCL all-reduce's result
is needed. Only device timing can tell which rank is slow and where.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import resilient_train as rt
from monitors.cupti_kernels import CuptiConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--slow-factor", type=float, default=1.5)
    p.add_argument("--work-s", type=float, default=0.02)
    p.add_argument("--gpu-work", action="store_true", help="the work is a GPU kernel (needs CUDA)")
    p.add_argument("--cupti-every", type=int, default=0, help="NVRx CUPTI kernel scores every N steps (0: off)")
    args = p.parse_args(argv)
    cupti = CuptiConfig(report_every_steps=args.cupti_every) if args.cupti_every else None
    sup = rt.Supervisor(rt.SupervisorConfig(steps=args.steps, cupti=cupti))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(sup.device)
    cycles_per_s = _cycles_per_s() if args.gpu_work else 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = rt.TrainState(model=model, optimizer=optimizer)

    def train_step(ctx: rt.StepContext) -> torch.Tensor:
        ctx.enter("data")
        g = torch.Generator().manual_seed(ctx.step * 100 + ctx.rank)
        x, y = torch.randn(16, 32, generator=g).to(sup.device), torch.randn(16, 1, generator=g).to(sup.device)
        ctx.enter("forward")
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        slow = ctx.rank == args.slow_rank and ctx.step >= args.slow_from
        if args.gpu_work:
            torch.cuda._sleep(int(args.work_s * (args.slow_factor if slow else 1.0) * cycles_per_s))
        else:
            time.sleep(args.work_s / 2)
        ctx.enter("backward")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not args.gpu_work:
            time.sleep(args.work_s / 2)
            if slow:
                time.sleep((args.slow_factor - 1.0) * (time.perf_counter() - t0))
        ctx.average_gradients()
        ctx.enter("optimizer")
        optimizer.step()
        return loss.detach()

    sup.run(train_step, state)
    return 0


def _cycles_per_s() -> float:
    """``torch.cuda._sleep`` spins for clock cycles: how many make a second on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (start.elapsed_time(end) / 1e3)


if __name__ == "__main__":
    sys.exit(main())
