"""What does validate mode cost on healthy steps? (CPU, 2 gloo ranks)

A real 2-rank job under the supervisor (plain torchrun-style environment, no
agent), training the GPT example's model with ``--rerun-mode
validate_results``. The step function switches validation on and off in
alternate blocks of steps, in the same processes, so both halves see the same
machine load: "on" is the whole healthy-step path (the loss reported through
``ctx.loss``, the local gradient norm before the all-reduce, the validators,
the verdict read off the gradient all-reduce (a rejecting rank poisons one
element with NaN), the machine's state in the published local state); "off" is the same job with the driver detached. Also the raw
cost of each piece on its own, which is below the noise of a shared machine.

Run: ``python bench/rerun_overhead.py [--blocks 20] [--steps-per-block 10] [--d-model 128]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch

    import resilient_train as rt
    from resilient_train.rank.rerun import RerunConfig
    from train_gpt import GPT, GPTConfig, batch

    warmup = 10
    steps = warmup + args.blocks * args.steps_per_block
    sup = rt.Supervisor(rt.SupervisorConfig(steps=steps, write_final=False,
                                            rerun=RerunConfig(mode="validate_results")))
    cfg = GPTConfig(d_model=args.d_model, layers=2, heads=4, seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    state = rt.TrainState(model=model, optimizer=opt)
    drivers: list = []  # the run's rerun driver, detached in "off" blocks: the stepper then skips every rerun hook
    starts: list[float] = []
    on_flags: list[bool] = []

    def train_step(ctx: rt.StepContext) -> torch.Tensor:
        starts.append(time.perf_counter())
        block = (ctx.step - warmup) // args.steps_per_block
        on = ctx.step < warmup or block % 2 == 0
        stepper = sup.current.stepper
        if not drivers:
            drivers.append(stepper.rerun)
        stepper.rerun = drivers[0] if on else None
        on_flags.append(on)
        ctx.enter("data")
        x, y = batch(0, ctx.step, ctx.data_rank, size=8, cfg=cfg, device=ctx.device)
        ctx.enter("forward")
        loss = ctx.loss(model(x, y))
        ctx.enter("backward")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        ctx.average_gradients()
        ctx.enter("optimizer")
        opt.step()
        return loss.detach()

    sup.run(train_step, state)
    starts.append(time.perf_counter())
    if rank != 0:
        return
    per = {True: [], False: []}
    blocks: dict[int, list[float]] = {}
    for i in range(warmup, steps):  # a step's time: its start to the next start (after_step and snapshot included)
        per[on_flags[i]].append(starts[i + 1] - starts[i])
        blocks.setdefault((i - warmup) // args.steps_per_block, []).append(starts[i + 1] - starts[i])
    # Each "on" block against the "off" block after it: drift in the machine's load cancels out.
    pairs = [100 * (statistics.median(blocks[b]) / statistics.median(blocks[b + 1]) - 1)
             for b in range(0, args.blocks - 1, 2)]

    # The pieces on their own.
    from resilient_train.rank.rerun import StepResult, ValidatorSet
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        float(torch.nn.utils.get_total_norm(grads))
    norm_us = (time.perf_counter() - t0) / n * 1e6
    v = ValidatorSet()
    for _ in range(50):
        v.commit(StepResult(2.0, 1.0))
    t0 = time.perf_counter()
    for _ in range(n):
        v.check(StepResult(2.0, 1.0))  # before the all-reduce
        v.check(StepResult(2.0, 1.0))  # after the step (an assertion)
        v.commit(StepResult(2.0, 1.0))
    check_us = (time.perf_counter() - t0) / n * 1e6
    g0 = grads[0].view(-1)
    t0 = time.perf_counter()
    for _ in range(n):
        bool(torch.isfinite(g0[0]))
    signal_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        json.dumps(drivers[0].state_dict())
    state_us = (time.perf_counter() - t0) / n * 1e6
    on_s, off_s = statistics.median(per[True]), statistics.median(per[False])
    Path(out).write_text(json.dumps({
        "step_on_s": on_s, "step_off_s": off_s, "overhead_pct": 100 * (on_s / off_s - 1),
        "steps_each": len(per[True]), "norm_us": norm_us, "check_us": check_us, "state_json_us": state_us,
        "signal_us": signal_us, "paired_pct": statistics.median(pairs),
        "params": sum(p.numel() for p in model.parameters()),
    }))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exchange_cost(world: int = 2, n: int = 2000) -> float:
    """One all-reduce of the decision table (world x 4 float64) between ``world`` gloo ranks, in us."""
    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(_exchange_worker, args=(world, _free_port(), n, out), nprocs=world, start_method="spawn")
    return json.loads(Path(out).read_text())["us"]


def _exchange_worker(rank: int, world: int, port: int, n: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.zeros(world, 4, dtype=torch.float64)
    for _ in range(50):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    us = (time.perf_counter() - t0) / n * 1e6
    if rank == 0:
        Path(out).write_text(json.dumps({"us": us}))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--steps-per-block", type=int, default=10)
    p.add_argument("--d-model", type=int, default=128)
    args = p.parse_args()
    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(_worker, args=(2, _free_port(), args, out), nprocs=2, start_method="spawn")
    r = json.loads(Path(out).read_text())
    ex_us = _exchange_cost()
    pieces_us = r["norm_us"] + r["check_us"] + r["state_json_us"] + r["signal_us"]
    print(f"GPT step (d_model {args.d_model}, 2 layers, batch 8x64, {r['params']} parameters, 2 gloo ranks, 1 thread "
          f"each), median of {r['steps_each']} steps each, interleaved in blocks of {args.steps_per_block}:")
    print(f"  validate off {r['step_off_s'] * 1e3:.2f} ms, on {r['step_on_s'] * 1e3:.2f} ms: {r['overhead_pct']:+.2f}%; "
          f"median of paired adjacent blocks {r['paired_pct']:+.2f}%")
    print(f"  per healthy step: local grad norm {r['norm_us']:.0f} us, validators {r['check_us']:.1f} us, machine state "
          f"JSON {r['state_json_us']:.1f} us, reading the verdict off the gradient all-reduce {r['signal_us']:.1f} us; "
          f"sum {pieces_us:.0f} us = {100 * pieces_us * 1e-6 / r['step_off_s']:.2f}% of the step")
    print(f"  only when a rank rejects: the decision table all-reduce {ex_us:.0f} us, then the re-runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
