"""The FSDP2 example's loop with no resilient-train at all, under plain torchrun: the reference.

Same model, data, optimizer, schedule, clipping and RNG streams as
examples/train_fsdp.py; at the end every rank takes part in DCP's full state
dict and rank 0 writes it (model, optimizer, scheduler) to OUT.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_fsdp import build, parallelize, parse_args, schedule  # noqa: E402

from checkpointing import write_state  # noqa: E402

if __name__ == "__main__":
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.replicas == 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh("cpu", (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
    model, batch_at = build(args, rank=rank, world=world, device=device)
    parallelize(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args))
    torch.manual_seed(args.seed * 7919 + rank)
    for step in range(args.steps):
        xb, yb = batch_at(step)
        loss = model(xb, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        write_state(out, {"model": model_sd, "optimizer": optim_sd, "replicated": {"scheduler": scheduler.state_dict()}},
                    step=args.steps)
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13's gloo sometimes aborts in interpreter finalization ("terminate called without an active
    # exception", SIGABRT, under torchrun too; pytorch/pytorch#179291): the reference skips it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
