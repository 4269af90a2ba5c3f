"""The GPT example instrumented for NVRx's ``ft_launcher`` (CPU, gloo), for bench/hang_latency.py.

The same model, data and sizes as examples/train_gpt.py, written as a plain
data-parallel loop the way NVRx's heartbeat example is: a
``RankMonitorClient`` per rank, a heartbeat after every step, heartbeat
timeouts calculated (``calculate_and_set_hb_timeouts``: 5 x the largest
observed interval, merged across ranks by an all-reduce) after ``--calc-at``
steps, and the client's state (the calculated timeouts) saved in the
checkpoint. Rank 0 checkpoints after every step (atomically), so a restart
loses no step: the best case for a restart-everything launcher.

Every rank appends JSON lines to ``OUT/events-rank{R}.jsonl``: ``worker_start``
(pid, attempt), ``fault_injected`` (then the rank SIGSTOPs itself, on the
first attempt only), ``timeouts`` (the heartbeat timeouts in force), and, on
rank 0, ``step_done`` after every step.

    ft_launcher --standalone --nproc-per-node 4 --ft-cfg-path CFG.yaml bench/nvrx_train_gpt.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

from train_gpt import GPT, GPTConfig, batch  # noqa: E402

import nvidia_resiliency_ext.fault_tolerance as ft  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--calc-at", type=int, default=5, help="calculate the heartbeat timeouts after this many steps")
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1, help="SIGSTOP before this step's forward (first attempt only)")
    args = p.parse_args()

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    log = open(out / f"events-rank{rank}.jsonl", "a", buffering=1)

    def emit(event: str, **kw: object) -> None:
        log.write(json.dumps({"event": event, "time": time.time(), "rank": rank, "attempt": attempt, **kw}) + "\n")

    emit("worker_start", pid=os.getpid())
    dist.init_process_group("gloo")
    cfg = GPTConfig(d_model=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.manual_seed(args.seed * 7919 + rank)

    client = ft.RankMonitorClient()
    ckpt_path = out / "ckpt.pt"
    step = 0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        client.load_state_dict(state["ft_state"])  # the calculated timeouts
    client.init_workload_monitoring()
    emit("timeouts", step=step, hb=dataclasses.asdict(client.hb_timeouts))

    params = list(model.parameters())
    while step < args.steps:
        x, y = batch(args.seed, step, rank, size=args.batch, cfg=cfg, device=torch.device("cpu"))
        if attempt == 0 and rank == args.hang_rank and step == args.hang_step:
            emit("fault_injected", step=step, pid=os.getpid(), kind="hang", phase="forward")
            os.kill(os.getpid(), signal.SIGSTOP)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for q in params:
            n = q.numel()
            q.grad.copy_(flat[offset:offset + n].view_as(q))
            offset += n
        optimizer.step()
        step += 1
        client.send_heartbeat()
        if step == args.calc_at and not client.hb_timeouts.were_calculated:
            client.calculate_and_set_hb_timeouts()  # a collective
            emit("timeouts", step=step, hb=dataclasses.asdict(client.hb_timeouts))
        if rank == 0:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "ft_state": client.state_dict()}, tmp)
            os.replace(tmp, ckpt_path)
            emit("step_done", step=step, loss=loss.item())
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
