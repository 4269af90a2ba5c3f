"""A small supervised job that goes wrong on purpose, the ways a user's script does (argv[1] says how).

* ``keyerror``: every step from step 3 raises KeyError (a plain bug);
* ``keyerror-rank1``: rank 1 alone raises KeyError at every step from step 3 (its peers are woken by the stop);
* ``transient``: rank 1 raises once, at step 3 (a passing glitch);
* ``ddp-before``: DDP is built before ``sup.run`` (no process group exists yet);
* ``ddp-once``: DDP is built only in the first ``on_new_group``; rank 1 then dies, and the old DDP is stale;
* ``ddp-user``: DDP is built in every ``on_new_group`` (works; the supervisor gives it the fixed-layout hook);
* ``unseeded``: the step draws from ``random`` without seeding it (two runs differ in that RNG's state).
* ``no-reducer``: 2 ranks step their optimizers with no sup.ddp and no ``ctx.average_gradients()``;
* ``ddp-bypassed``: the model is wrapped with ``sup.ddp`` but the step calls the bare model;
* ``ddp-in-step``: DDP is built inside the step, again in each generation (rank 1 raises once at step 3);
* ``ddp-in-step-once``: DDP is built inside the step once and kept (rank 1 raises once at step 3);
* ``state-ddp`` / ``state-bare``: ``TrainState(model=sup.ddp(model))`` and ``TrainState(model=model)``;
* ``iterator``: the batch is ``next(iterator)``; rank 1 raises once at step 3, once rank 0 has fed its
  model step 3's batch (a file in the run directory says so), and the survivors redo step 3.
"""

import itertools
import os
import random
import signal
import sys
import time
from pathlib import Path

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
replicated = sup.ddp(model) if mode in ("ddp-bypassed", "state-ddp", "state-bare") else None
batches = (torch.full((2, 4), float(i)) for i in itertools.count())
marker = Path(sup.env.run_dir or ".") / "rank0-fed-step3"


def on_new_group() -> None:
    if mode == "ddp-user" or (mode == "ddp-once" and not wrapped):
        wrapped["ddp"] = DDP(model)


def train_step(ctx: rt.StepContext) -> torch.Tensor:
    if (mode == "keyerror" or (mode == "keyerror-rank1" and ctx.rank == 1)) and ctx.step >= 3:
        {}["missing"]
    if mode in ("transient", "ddp-in-step", "ddp-in-step-once", "iterator") and ctx.step == 3 \
            and ctx.generation == 0 and ctx.rank == 1:
        while mode == "iterator" and not marker.exists():
            time.sleep(0.01)
        raise RuntimeError("a passing glitch")
    if mode == "iterator":
        loss = model(next(batches) * (ctx.rank + 1)).sum()
        if ctx.step == 3 and ctx.rank == 0:
            marker.touch()
        optimizer.zero_grad()
        loss.backward()
        ctx.average_gradients()
        optimizer.step()
        return loss.detach()
    if mode == "ddp-in-step" and wrapped.get("generation") != ctx.generation:
        wrapped["generation"], wrapped["ddp"] = ctx.generation, DDP(model)
    if mode == "ddp-in-step-once" and "ddp" not in wrapped:
        wrapped["ddp"] = DDP(model)
    if mode == "ddp-once" and ctx.step == 5 and ctx.rank == 1 and ctx.generation == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "unseeded":
        random.random()
    net = wrapped.get("ddp", replicated if mode.startswith("state-") else model)
    loss = net(torch.ones(2, 4) * (ctx.rank + 1)).sum()
    optimizer.zero_grad()
    loss.backward()
    if "ddp" not in wrapped and mode not in ("no-reducer", "ddp-bypassed", "state-ddp", "state-bare"):
        ctx.average_gradients()
    optimizer.step()
    return loss.detach()


state = rt.TrainState(model=replicated if mode == "state-ddp" else model, optimizer=optimizer)
sup.run(train_step, state, on_new_group=on_new_group)
