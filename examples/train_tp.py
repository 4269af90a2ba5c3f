"""Tensor parallel × data parallel on a 2-D mesh (``parallelize_module``) under resilient-train.

The mesh is ``(dp, tp)``: within a ``tp`` group each block's MLP is split
Megatron-style (the first linear by columns, the second by rows); attention,
embeddings and norms are replicated. Across ``dp`` the whole state is
replicated, so a lost rank heals from its DP peer (the rank with the same
``tp`` coordinate). Gradients are averaged over ``dp`` one parameter at a time
after backward: a fixed layout, the same bits in every generation.

    resilient-train run --nproc-per-node 4 --run-dir runs/tp examples/train_tp.py --tp 2 --steps 100

On CPU it runs with gloo, on GPUs with NCCL (the supervisor picks the backend).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import resilient_train as rt  # rt:
from train_fsdp import build, checkpoints, schedule
from train_fsdp import parse_args as fsdp_args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    tp = 2
    if "--tp" in argv:
        i = argv.index("--tp")
        tp = int(argv[i + 1])
        del argv[i:i + 2]
    args = fsdp_args(argv)
    args.tp = tp
    return args


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Each block's MLP split over ``tp``: the usual column-then-row plan."""
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh["tp"], {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})


def average_over_dp(params: list[torch.nn.Parameter], dp_group: dist.ProcessGroup, dp: int) -> None:
    """Data-parallel gradient average over ``dp``, one local tensor at a time (the same cut every generation)."""
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, group=dp_group)
        g.div_(dp)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, tp_group: dist.ProcessGroup) -> None:
    """Global-norm clipping over a mix of tp-sharded (DTensor) and replicated gradients.

    ``torch.nn.utils.clip_grad_norm_`` refuses the mix; the squares of the shards
    are summed over ``tp``, the replicated ones counted once.
    """
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.stack([g.double().pow(2).sum() for g in sharded]).sum() if sharded else torch.zeros((), dtype=torch.double)
    dist.all_reduce(sq, group=tp_group)
    if plain:
        sq = sq + torch.stack([g.double().pow(2).sum() for g in plain]).sum()
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0).float()
    for g in sharded + plain:
        g.mul_(coef)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Only what this script's flags set is passed: the rest is the run config's (--checkpoint.interval=N, ...).
    own = {k: v for k, v in (("checkpoint", checkpoints(args)), ("reproducible", args.reproducible or None))
           if v is not None}
    sup = rt.Supervisor(rt.SupervisorConfig.from_run_config(steps=args.steps, **own))  # rt:
    rank, world, device = sup.env.rank, sup.env.world_size, sup.device  # rt:
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide {world} ranks")
    dp, dp_rank = world // args.tp, rank // args.tp
    # Every tp rank of a dp group computes the same batch, with the same dropout stream.
    model, batch_at = build(args, rank=dp_rank, world=dp, device=device)
    spec = rt.MeshSpec(shape=(dp, args.tp), names=("dp", "tp"), replicate=("dp",))  # rt:
    sharded = sup.sharded(model, parallelize, mesh=spec)  # rt: instead of parallelize(model, mesh)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args))
    torch.manual_seed(args.seed * 7919 + dp_rank)

    def train_step(ctx: rt.StepContext) -> torch.Tensor:  # rt: the loop body, as a function of the step
        xb, yb = batch_at(ctx.step)
        loss = sharded(xb, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ctx.enter("all-reduce")
        params = list(sharded.parameters())
        average_over_dp(params, sup.mesh["dp"].get_group(), dp)  # rt: sup.mesh, this generation's mesh
        clip_grad_norm(params, args.clip, sup.mesh["tp"].get_group())
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
