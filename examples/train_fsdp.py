"""An FSDP2 (``fully_shard``) training loop under resilient-train; HSDP with ``--replicas R``.

The loop is a standard FSDP2 one: each transformer block and then the whole
model are sharded with ``fully_shard`` on a device mesh, AdamW, an LR schedule,
gradient clipping. The lines marked ``# rt:`` are the changes from its plain
torchrun version: the supervisor builds the mesh each generation and applies
``parallelize`` itself (a mesh from a failed generation is finished), so the
model is handed over before it is sharded.

    resilient-train run --nproc-per-node 4 --run-dir runs/fsdp examples/train_fsdp.py --steps 100
    resilient-train run --nproc-per-node 4 --run-dir runs/hsdp examples/train_fsdp.py --replicas 2

With ``--ckpt-every N`` each rank writes its own shards to RUN_DIR/checkpoints
every N steps: the fallback when a rank and its buddy are lost at once, and a
way to go on at another size: the same command with another
``--nproc-per-node`` (or ``train_gpt.py --ckpt-every N``, data-parallel) on the
same run directory resumes from the newest checkpoint, resharded.

On CPU it runs with gloo, on GPUs with NCCL (the supervisor picks the backend).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset

import resilient_train as rt  # rt:
from checkpointing import CheckpointConfig
from resilient_train.rank.disk import default_checkpoint_config
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
    p.add_argument("--replicas", type=int, default=1, help="HSDP: replica groups (1: plain FSDP over every rank)")
    p.add_argument("--buddy-every", type=int, default=0,
                   help="refresh the buddy copies every k steps (plain FSDP; 0, the default: an interval the job "
                        "chooses from its first steps, the copies at most 2%% of the step time)")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="disk checkpoint interval in steps, under RUN_DIR/checkpoints (0: none; needs a run dir)")
    p.add_argument("--ckpt-mode", choices=["process", "disabled"], default="process",
                   help="process: saves are written by a background process (default); disabled: saves block")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--reproducible", action="store_true", help="deterministic kernels, one intra-op thread")
    args = p.parse_args(argv)
    if (args.steps < 0 or args.batch < 1 or args.dataset < 1 or args.replicas < 1
            or args.buddy_every < 0):
        p.error("--steps and --buddy-every must be >= 0; --batch, --dataset and --replicas >= 1")
    if args.ckpt_every < 0:
        p.error("--ckpt-every must be >= 0")
    return args


def mesh_spec(replicas: int) -> rt.MeshSpec:
    if replicas == 1:
        return rt.MeshSpec(shape=(-1,), names=("shard",))
    return rt.MeshSpec(shape=(replicas, -1), names=("replicate", "shard"), replicate=("replicate",))


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 as usual: each block, then the root (a 2-D mesh makes it HSDP)."""
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build(args: argparse.Namespace, *, rank: int, world: int, device: torch.device
          ) -> tuple[GPT, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    """The model (seeded, unsharded) and the batch of each step (by index: any step's batch is found again)."""
    cfg = GPTConfig(d_model=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    x, y = batch(args.seed, 0, 0, size=args.dataset, cfg=cfg, device=torch.device("cpu"))
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    per_epoch = len(sampler) // args.batch
    if per_epoch < 1:
        raise SystemExit(f"--dataset {args.dataset} is too small for {world} ranks of --batch {args.batch}")
    epoch_indices: dict[int, list[int]] = {}

    def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = divmod(step, per_epoch)
        if epoch not in epoch_indices:
            sampler.set_epoch(epoch)
            epoch_indices.clear()
            epoch_indices[epoch] = list(sampler)
        idx = epoch_indices[epoch][i * args.batch:(i + 1) * args.batch]
        return x[idx].to(device), y[idx].to(device)

    torch.manual_seed(args.seed)
    return GPT(cfg).to(device), batch_at


def checkpoints(args: argparse.Namespace) -> CheckpointConfig | None:
    """``--ckpt-every N``: every rank's shards under RUN_DIR/checkpoints every N steps."""
    run_dir = rt.WorkerEnv.from_environ().run_dir
    if not args.ckpt_every or not run_dir:
        return None
    return default_checkpoint_config(run_dir, args.ckpt_every, mode=args.ckpt_mode)


def schedule(args: argparse.Namespace) -> Callable[[int], float]:
    return lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * s / max(args.steps, 1)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Only what this script's flags set is passed: the rest is the run config's (--config FILE,
    # --checkpoint.interval=N; the chaos runner's supervisor.reproducible), else the fields' defaults.
    own = {k: v for k, v in (("buddy_every", args.buddy_every or None), ("checkpoint", checkpoints(args)),
                             ("reproducible", args.reproducible or None)) if v is not None}
    sup = rt.Supervisor(rt.SupervisorConfig.from_run_config(steps=args.steps, **own))  # rt:
    rank, world, device = sup.env.rank, sup.env.world_size, sup.device  # rt:
    model, batch_at = build(args, rank=rank, world=world, device=device)
    sharded = sup.sharded(model, parallelize, mesh=mesh_spec(args.replicas))  # rt: instead of parallelize(model, mesh)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args))
    torch.manual_seed(args.seed * 7919 + rank)  # each rank its own dropout stream

    def train_step(ctx: rt.StepContext) -> torch.Tensor:  # rt: the loop body, as a function of the step
        xb, yb = batch_at(ctx.step)
        loss = sharded(xb, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
        if rank == 0 and args.log_every and (ctx.step + 1) % args.log_every == 0:
            print(f"step {ctx.step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
        return loss.detach()

    state = rt.TrainState(model=sharded, optimizer=optimizer, replicated={"scheduler": scheduler})  # rt:
    sup.run(train_step, state)  # rt:
    return 0


if __name__ == "__main__":
    sys.exit(main())
