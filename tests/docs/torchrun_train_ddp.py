"""A standard DDP training loop, adopted by resilient-train with a handful of changed lines.

What a DDP script usually has is all here: a dataset read through a
``DistributedSampler`` (by index, so any step's batch can be found again), an
LR schedule with warmup, gradient clipping, bf16 autocast on a GPU. The lines
marked ``# rt:`` are the changes from the plain torchrun version (see
docs/ddp.md for the diff):

    resilient-train run --nproc-per-node 3 --run-dir runs/ddp examples/train_ddp.py --steps 100
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from torch.utils.data import DistributedSampler, TensorDataset

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from train_gpt import GPT, GPTConfig, batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--dataset", type=int, default=2048, help="sequences in the dataset")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="warmup steps of the LR schedule")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--reproducible", action="store_true", help="deterministic kernels, one intra-op thread")
    args = p.parse_args(argv)
    if args.steps < 0 or args.batch < 1 or args.dataset < 1:
        p.error("--steps must be >= 0, --batch and --dataset >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    cfg = GPTConfig(d_model=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len)

    x, y = batch(args.seed, 0, 0, size=args.dataset, cfg=cfg, device=torch.device("cpu"))
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    per_epoch = len(sampler) // args.batch
    if per_epoch < 1:
        raise SystemExit(f"--dataset {args.dataset} is too small for {world} ranks of --batch {args.batch}")
    epoch_indices: dict[int, list[int]] = {}

    def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step``: its epoch's shuffled indices, read by position."""
        epoch, i = divmod(step, per_epoch)
        if epoch not in epoch_indices:
            sampler.set_epoch(epoch)
            epoch_indices.clear()
            epoch_indices[epoch] = list(sampler)
        idx = epoch_indices[epoch][i * args.batch:(i + 1) * args.batch]
        return x[idx].to(device), y[idx].to(device)

    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * s / max(args.steps, 1))))
    torch.manual_seed(args.seed * 7919 + rank)  # each rank its own dropout stream

    for step in range(args.steps):
        xb, yb = batch_at(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = ddp(xb, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
        if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                  flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
