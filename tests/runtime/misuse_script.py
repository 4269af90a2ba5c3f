"""A small supervised job that goes wrong on purpose, the ways a user's script does (argv[1] says how).

* ``keyerror``: every step from step 3 raises KeyError (a plain bug);
* ``keyerror-rank1``: rank 1 alone raises KeyError at every step from step 3 (its peers are woken by the stop);
* ``transient``: rank 1 raises once, at step 3 (a passing glitch);
* ``ddp-before``: DDP is built before ``sup.run`` (no process group exists yet);
* ``ddp-once``: DDP is built only in the first ``on_new_group``; rank 1 then dies, and the old DDP is stale;
* ``ddp-user``: DDP is built in every ``on_new_group`` (works; the supervisor gives it the fixed-layout hook);
* ``unseeded``: the step draws from ``random`` without seeding it (two runs differ in that RNG's state).
"""

import os
import random
import signal
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient_train as rt

mode = sys.argv[1]
sup = rt.Supervisor(rt.SupervisorConfig(steps=20))
torch.manual_seed(0)  # torch is seeded; random and NumPy are not
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
wrapped: dict[str, DDP] = {}
if mode == "ddp-before":
    DDP(model)


def on_new_group() -> None:
    if mode == "ddp-user" or (mode == "ddp-once" and not wrapped):
        wrapped["ddp"] = DDP(model)


def train_step(ctx: rt.StepContext) -> torch.Tensor:
    if (mode == "keyerror" or (mode == "keyerror-rank1" and ctx.rank == 1)) and ctx.step >= 3:
        {}["missing"]
    if mode == "transient" and ctx.step == 3 and ctx.generation == 0 and ctx.rank == 1:
        raise RuntimeError("a passing glitch")
    if mode == "ddp-once" and ctx.step == 5 and ctx.rank == 1 and ctx.generation == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "unseeded":
        random.random()
    net = wrapped.get("ddp", model)
    loss = net(torch.ones(2, 4) * (ctx.rank + 1)).sum()
    optimizer.zero_grad()
    loss.backward()
    if "ddp" not in wrapped:
        ctx.average_gradients()
    optimizer.step()
    return loss.detach()


sup.run(train_step, rt.TrainState(model=model, optimizer=optimizer), on_new_group=on_new_group)
