"""A supervised job that reads its batches through a DataLoader with worker processes (fork, persistent), as
real loops do: argv[1] is the steps. Each batch is a function of its index, and the loader's position is the
step (a sampler that starts at the step the state stands at)."""

import sys

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import resilient_train as rt

steps = int(sys.argv[1])
sup = rt.Supervisor(rt.SupervisorConfig(steps=steps, reproducible=True))
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
state = rt.TrainState(model=model, optimizer=optimizer)


class Batches(Dataset):
    def __len__(self) -> int:
        return steps

    def __getitem__(self, step: int) -> torch.Tensor:
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + sup.env.rank))


class FromStep(Sampler):
    def __iter__(self):
        return iter(range(state.step, steps))


loader = DataLoader(Batches(), batch_size=None, sampler=FromStep(), num_workers=2, persistent_workers=True)
batches = {"it": None, "at": -1}


def train_step(ctx: rt.StepContext) -> torch.Tensor:
    if batches["at"] != ctx.step:  # a new iterator from the state's step (after a recovery, too)
        batches["it"], batches["at"] = iter(loader), ctx.step
    x = next(batches["it"])
    batches["at"] += 1
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    ctx.average_gradients()
    optimizer.step()
    return loss.detach()


sup.run(train_step, state)
