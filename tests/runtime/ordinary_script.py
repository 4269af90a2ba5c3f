"""A small supervised job with what ordinary training loops do now and then (argv[1] says what, argv[2] the steps).

* ``after-commit``: rank 0 raises the same ValueError after ``optimizer.step()`` every 20 steps, where metrics
  and logging code lives (a bug that never shows on a replay: the step it follows is committed);
* ``exit0-once``: rank 1 leaves with ``sys.exit(0)`` at step 10, in its first process only (its replacement
  trains on: a fault);
* ``exit0-always``: rank 1 leaves with ``sys.exit(0)`` at step 10, every time (a bug);
* ``oexit0-always``: the same with ``os._exit(0)``;
* ``plain``: none of it.
"""

import os
import sys

import torch

import resilient_train as rt

mode, steps = sys.argv[1], int(sys.argv[2])
sup = rt.Supervisor(rt.SupervisorConfig(steps=steps, reproducible=True))
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(ctx: rt.StepContext) -> torch.Tensor:
    if ctx.rank == 1 and ctx.step == 10 and (mode.endswith("-always") or (mode == "exit0-once"
                                                                          and not sup.env.replacement)):
        if mode.startswith("oexit0"):
            os._exit(0)
        sys.exit(0)
    g = torch.Generator().manual_seed(ctx.step * 100 + ctx.data_rank)
    loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    ctx.average_gradients()
    optimizer.step()
    if mode == "after-commit" and ctx.rank == 0 and (ctx.step + 1) % 20 == 0:
        raise ValueError(f"metrics: cannot log step {ctx.step + 1}: the writer is closed")
    return loss.detach()


sup.run(train_step, rt.TrainState(model=model, optimizer=optimizer))
