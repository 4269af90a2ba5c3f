"""Steady cost of the supervisor on FSDP2: a plain ``fully_shard`` loop and the same under the supervisor, interleaved.

Every rank runs the variants in turn (in reverse order every other round), a few rounds, each
block on a freshly built (same seed) model:

* ``plain``: ``init_process_group`` + ``init_device_mesh`` + ``fully_shard`` + AdamW, the usual step;
* ``auto``: the same step under ``Supervisor.run`` with ``sup.sharded`` and default settings
  (the commit vote, the published local state, progress slot, events, the buddy copies at the
  interval the job chooses from its first steps, printed once);
* ``buddy1`` / ``buddy10``: the same with the buddy copy refreshed every 1 / 10 steps.

Printed: the median step time of each variant and its ratio to ``plain``, the
bytes a refresh sends per rank, the interval chosen, and the peak host memory
of the first block of each variant (VmHWM, reset before it).

    python bench/sharded_overhead.py --nproc 4 --preset small
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

PRESETS = {  # d_model, layers, heads, seq_len
    "small": dict(d_model=256, layers=4, heads=4, seq_len=64),
    "tiny": dict(d_model=64, layers=2, heads=2, seq_len=32),
}
VARIANTS = ("plain", "auto", "buddy1", "buddy10")


def _hwm_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _hwm_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split(":")[1].split()[0]) / 2**20
    return 0.0


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import resilient_train as rt
    from resilient_train.protocol import env as E
    from train_fsdp import parallelize
    from train_gpt import GPT, GPTConfig, batch

    os.environ.update({E.RANK: str(rank), E.LOCAL_RANK: str(rank), E.WORLD_SIZE: str(world),
                       E.MASTER_ADDR: "127.0.0.1", E.MASTER_PORT: str(port), E.TORCHELASTIC_USE_AGENT_STORE: "True",
                       E.RT_RUN_DIR: tempfile.mkdtemp(prefix=f"sharded-rank{rank}-")})
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    cfg = GPTConfig(dropout=0.0, **PRESETS[args.preset])
    total = args.warmup + args.steps
    results: list[dict[str, Any]] = []

    def model() -> GPT:
        torch.manual_seed(0)
        return GPT(cfg)

    def one_step(net: Any, optimizer: Any, step: int) -> Any:
        x, y = batch(0, step, rank, size=args.batch, cfg=cfg, device=torch.device("cpu"))
        loss = net(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    for rnd in range(args.rounds):
        for variant in (args.variants if rnd % 2 == 0 else args.variants[::-1]):  # drift falls on all alike
            _hwm_reset()
            stamps: list[float] = []
            extra: dict[str, Any] = {}
            if variant == "plain":
                dist.init_process_group("gloo", store=dist.PrefixStore(f"plain-{rnd}", store), rank=rank,
                                        world_size=world, timeout=timedelta(seconds=120))
                net = model()
                parallelize(net, init_device_mesh("cpu", (world,)))
                optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
                for step in range(total + 1):
                    stamps.append(time.perf_counter())
                    one_step(net, optimizer, step)
                del net, optimizer
                dist.destroy_process_group()
            else:
                os.environ[E.RT_JOB_TOKEN] = f"{variant}-{rnd}"  # each block its own keys
                every = {"auto": None, "buddy1": 1, "buddy10": 10}[variant]
                sup = rt.Supervisor(rt.SupervisorConfig(steps=total + 1, write_final=False, buddy_every=every))
                sharded = sup.sharded(model(), parallelize)
                optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
                state = rt.TrainState(model=sharded, optimizer=optimizer)

                def train_step(ctx: rt.StepContext) -> Any:
                    stamps.append(time.perf_counter())
                    return one_step(sharded, optimizer, ctx.step)

                sup.run(train_step, state)
                if sup.buddy is not None and sup.buddy.own:
                    extra["refresh_bytes"] = sup.buddy.own[-1].nbytes
                if sup.buddy is not None:
                    extra["every"] = sup.buddy.every
                    extra["chosen"] = sup.buddy.interval.chosen
            timed = stamps[args.warmup:]
            step_s = (timed[-1] - timed[0]) / (len(timed) - 1)
            results.append({"round": rnd, "variant": variant, "step_s": step_s, "hwm_gib": _hwm_gib(), **extra})
            if rank == 0 and not args.quiet:
                print(f"  round {rnd} {variant:<8} {step_s * 1e3:8.2f} ms/step", flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"results": results, "torch": torch.__version__,
                                              "params": sum(p.numel() for p in model().parameters())}))
    store.set(f"bench/done/{rank}", "1")
    store.wait([f"bench/done/{r}" for r in range(world)], timedelta(seconds=120))
    sys.stdout.flush()
    os._exit(0)  # gloo's worker threads can abort the interpreter's exit ("terminate called"): nothing is left to do


def summarize(data: dict[str, Any]) -> str:
    rows = ["| variant | step (median) | ratio to plain | bytes sent per refresh (rank 0) | every | host peak | ratio |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    res = data["results"]
    by = {v: [r for r in res if r["variant"] == v] for v in VARIANTS}
    base = statistics.median(r["step_s"] for r in by["plain"]) if by["plain"] else None
    base_mem = by["plain"][0]["hwm_gib"] if by["plain"] else None
    for v, rs in by.items():
        if not rs:
            continue
        step = statistics.median(r["step_s"] for r in rs)
        mem = rs[0]["hwm_gib"]
        sent = f"{rs[-1]['refresh_bytes'] / 2**20:.2f} MiB" if "refresh_bytes" in rs[-1] else "-"
        ratio = f"{step / base:.3f}x" if base else "-"
        mratio = f"{mem / base_mem:.2f}x" if base_mem else "-"
        every = sorted({r.get("every") for r in rs if r.get("every") is not None})
        rows.append(f"| {v} | {step * 1e3:.1f} ms | {ratio} | {sent} | {', '.join(map(str, every)) or '-'} "
                    f"| {mem:.2f} GiB | {mratio} |")
    for r in res:
        if r["variant"] == "auto" and r.get("chosen"):
            c = r["chosen"]
            rows.append(f"\nauto, round {r['round']}: every {c['every']} steps (rank 0 measured a refresh of "
                        f"{c['refresh_s'] * 1e3:.1f} ms and a step of {c['step_s'] * 1e3:.1f} ms)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each block")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if args.nproc < 2 or args.rounds < 1 or args.steps < 2 or args.warmup < 0:
        p.error("--nproc must be >= 2, --rounds >= 1, --steps >= 2, --warmup >= 0")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    out = tempfile.mktemp(suffix=".json", prefix="sharded-")
    print(f"sharded_overhead: {args.preset} GPT, FSDP2 on {args.nproc} CPU ranks (gloo), batch {args.batch}, "
          f"{args.rounds} rounds x {args.variants}, {args.warmup}+{args.steps} steps a block", flush=True)
    mp.start_processes(_rank_main, args=(args.nproc, master.port, args, out), nprocs=args.nproc, start_method="spawn")
    data = json.loads(Path(out).read_text())
    print(f"\n{data['params'] / 1e6:.1f}M parameters, torch {data['torch']}")
    print(summarize(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
