"""A Supervisor job whose ranks print every step, for the console tests (tests/runtime/test_workerio.py).

Each rank prints ``hello from rank R``; rank 0 then waits for a line on stdin
(the agent's stdin: the test writes it once it has closed its end of the
agent's stdout, so every later line meets a closed console). Then ``--steps``
steps, rank 0 printing ``step N`` on stdout and rank 1 ``rank1 step N`` on
stderr, every step.
"""

import argparse
import sys

import torch

import resilient_train as rt

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
args = p.parse_args()
env = rt.WorkerEnv.from_environ()
print(f"hello from rank {env.rank}", flush=True)
if env.rank == 0:
    sys.stdin.readline()
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(ctx: rt.StepContext) -> torch.Tensor:
    loss = model(torch.ones(2, 4)).sum()
    optimizer.zero_grad()
    loss.backward()
    ctx.average_gradients()
    optimizer.step()
    if ctx.rank == 0:
        print(f"step {ctx.step + 1}", flush=True)
    else:
        print(f"rank1 step {ctx.step + 1}", file=sys.stderr, flush=True)
    return loss.detach()


rt.Supervisor(rt.SupervisorConfig(steps=args.steps)).run(train_step, rt.TrainState(model=model, optimizer=optimizer))
