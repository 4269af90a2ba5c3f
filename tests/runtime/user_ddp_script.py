"""The README's pattern: the script builds its own DDP in ``on_new_group`` (a small GPT, 3 ranks or more).

With ``--barrier DIR --fault-step K`` it sets up, with files rather than timing,
the moment that once hung such a job for good (issue 22): at step K of
generation 0, every rank but 0 waits in its data phase (it writes
``DIR/waiting-R``), so rank 0's all-reduce is launched and stays pending;
the test SIGKILLs the last rank from outside. Rank 0's gloo worker thread is
then still in that collective, waiting on rank 1, when the next generation's
``on_new_group`` drops the old DDP: rank 0 drops first (``DIR/dropped-0``
once it has), and rank 1 keeps its old DDP, and with it its sockets, until
then (30 s at most). The old DDP held the last reference to the failed
group, whose destructor then ran on rank 0's main thread, with the GIL,
joining a worker thread that waited for the GIL to run its collective's
callback.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_gpt import GPT, GPTConfig, batch  # noqa: E402

import resilient_train as rt  # noqa: E402

WAIT_S = 60.0  # a wait the test should have ended long before
HOLD_S = 30.0  # rank 1 keeps its old DDP at most this long for rank 0 to drop its own

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=24)
p.add_argument("--barrier", type=Path, default=None)
p.add_argument("--fault-step", type=int, default=-1)
p.add_argument("--reproducible", action="store_true", help="one intra-op thread, deterministic algorithms")
args = p.parse_args()
cfg = GPTConfig(vocab=64, seq_len=16, d_model=32, layers=2, heads=2)
sup = rt.Supervisor(rt.SupervisorConfig(steps=args.steps, **({"reproducible": True} if args.reproducible else {})))
rank = sup.env.rank
torch.manual_seed(0)
model = GPT(cfg)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(7919 + rank)
random.seed(7919 + rank)
holder: dict[str, DDP] = {}


def _wait_for(path: Path, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def on_new_group() -> None:
    new = DDP(model)
    old = holder.pop("ddp", None)
    if old is not None and args.barrier is not None and rank == 1:
        _wait_for(args.barrier / "dropped-0", HOLD_S)
    holder["ddp"] = new
    del old  # a survivor's DDP of the failed generation goes here
    if args.barrier is not None and rank == 0 and sup.generation > 0:
        (args.barrier / "dropped-0").touch()


def train_step(ctx: rt.StepContext) -> torch.Tensor:
    ctx.enter("data")
    if args.barrier is not None and ctx.step == args.fault_step and ctx.generation == 0 and rank != 0:
        (args.barrier / f"waiting-{rank}").touch()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            ctx.enter("data")  # raises once the generation was declared failed
            time.sleep(0.02)
        raise RuntimeError(f"rank {rank}: the test never killed the last rank")
    x, y = batch(0, ctx.step, ctx.data_rank, size=4, cfg=cfg, device=ctx.device)
    ctx.enter("forward")
    loss = holder["ddp"](x, y)
    ctx.enter("backward")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    ctx.enter("optimizer")
    optimizer.step()
    return loss.detach()


sup.run(train_step, rt.TrainState(model=model, optimizer=optimizer), on_new_group=on_new_group)
