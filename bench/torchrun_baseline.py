"""The anchor for bench/recovery.py: the same GPT under plain torchrun.

Plain DDP, a synchronous torch.distributed.checkpoint save every
``--ckpt-every`` steps, and a resume from the newest one when torchrun restarts
the workers. It SIGKILLs rank ``--kill-rank`` at step ``--kill-step`` in the
first attempt only. Steps go to ``--events`` as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_gpt import GPT, GPTConfig, batch  # noqa: E402



def log(path: str, **fields) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), **fields}) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    cfg = GPTConfig(d_model=args.d_model, layers=args.layers, heads=4, seq_len=args.seq_len)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(7919 + rank)
    random.seed(7919 + rank)
    start = 0
    ckpts = sorted(Path(args.ckpt_dir).glob("step-*"), key=lambda d: int(d.name.split("-")[1]))
    ckpts = [d for d in ckpts if (d / ".metadata").exists()]
    if ckpts:
        # The optimizer state must exist before DCP can load into it.
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        for group in opt.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=str(ckpts[-1]))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(ckpts[-1].name.split("-")[1])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if rank == 0:
        log(args.events, event="resumed", step=start, attempt=attempt)
    for step in range(start, args.steps):
        if attempt == 0 and step == args.kill_step and rank == args.kill_rank:
            log(args.events, event="fault_injected", step=step, rank=rank)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(0, step, rank, size=args.batch, cfg=cfg, device=torch.device("cpu"))
        loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % args.ckpt_every == 0:
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                     checkpoint_id=os.path.join(args.ckpt_dir, f"step-{step + 1}"))
        if rank == 0:
            log(args.events, event="step_done", step=step + 1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
