"""Steady cost of the supervisor: a plain DDP loop and the same loop under the supervisor, interleaved.

Every rank runs the variants in turn (in reverse order every other round), a few rounds, on the
same model and optimizer (training simply goes on from block to block):

* ``plain``: ``init_process_group`` + ``DDP(model)`` + the usual step;
* ``sup``: the same step under ``Supervisor.run`` with ``sup.ddp(model)``, default settings
  (progress slot for the agent's monitors, events, the commit vote, published local state);
* ``final``: ``sup`` that also writes the final state (``RUN_DIR/final``) at its end, first round
  only: its host peak includes the streamed write, its ``final`` column the write's seconds;
* ``snap1``/``snap10``: the same with a host snapshot every 1 / 10 steps;
* ``ordered``: ``sup`` with the layout-independent reduction of an elastic job
  (``SupervisorConfig(ordered_reduction=True)``: per bucket an all-to-all, a sum in
  logical-rank order, an all-gather, instead of one all-reduce).

``--force-reduction`` runs the supervised variants on the path of a world
larger than one even at one rank (``SupervisorConfig(force_reduction=True)``:
DDP's buckets reduced through the hook, the vote's all-reduce), so one GPU
shows that path's cost beside the plain DDP loop (which all-reduces its
buckets at one rank too). ``--autocast bf16`` runs forward in bf16 autocast.

Printed: the median step time of each variant and its ratio to ``plain``, and
the peak host memory (VmHWM, reset before the variant's first block, in the
first round: plain and sup run before any snapshot's pinned buffers exist)
and its ratio; whether DDP's buckets were the reducer's plan (no copy) on
every step. On a GPU also: how long the snapshot's device-to-host copy took on
its side stream (CUDA events).

    python bench/steady_overhead.py --preset 808m --batch 8 32 --autocast bf16 --force-reduction --item-every 1
    python bench/steady_overhead.py --preset 20m --nproc 2 --device cpu   # CPU, 2 ranks
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
    "808m": dict(d_model=2048, layers=16, heads=16, seq_len=512),
    "20m": dict(d_model=512, layers=6, heads=8, seq_len=128),
    "tiny": dict(d_model=64, layers=2, heads=2, seq_len=32),
}
VARIANTS = ("plain", "sup", "final", "snap1", "snap10", "ordered")
DEFAULT_VARIANTS = ("plain", "sup", "snap1", "snap10")


def _hwm_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _mem() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmHWM", "VmRSS")):
            name, value = line.split(":")
            out[name] = int(value.split()[0]) / 2**20  # GiB
    return out


class Block:
    """Times ``steps`` steps after ``warmup``: from the first timed step's start to the next step's start."""

    def __init__(self, warmup: int, steps: int, sync: Any) -> None:
        self.warmup, self.steps, self._sync = warmup, steps, sync
        self.count = 0
        self.t0 = self.t1 = 0.0

    def tick(self) -> None:
        if self.count == self.warmup:
            self._sync()
            self.t0 = time.perf_counter()
        elif self.count == self.warmup + self.steps:
            self._sync()
            self.t1 = time.perf_counter()
        self.count += 1

    @property
    def step_s(self) -> float:
        return (self.t1 - self.t0) / self.steps


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import resilient_train as rt
    from resilient_train.protocol import env as E
    from train_gpt import GPT, GPTConfig, batch

    run_dir = tempfile.mkdtemp(prefix=f"steady-rank{rank}-")
    os.environ.update({E.RANK: str(rank), E.LOCAL_RANK: str(rank), E.WORLD_SIZE: str(world),
                       E.MASTER_ADDR: "127.0.0.1", E.MASTER_PORT: str(port), E.TORCHELASTIC_USE_AGENT_STORE: "True",
                       E.RT_RUN_DIR: run_dir})
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(args.threads)
    backend = "nccl" if cuda else "gloo"
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    cfg = GPTConfig(dropout=0.0, **PRESETS[args.preset])
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    nparams = sum(p.numel() for p in model.parameters())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results: list[dict[str, Any]] = []
    step_no = 0

    autocast = args.autocast == "bf16"

    def one_step(net: Any, step: int, size: int) -> torch.Tensor:
        x, y = batch(0, step, rank, size=size, cfg=cfg, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = net(x, y)
        if args.item_every and step % args.item_every == 0:
            loss.item()  # a loop that logs its loss reads it back from the device
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    for rnd in range(args.rounds):
        for size in args.batch:
            # odd rounds in the reverse order: a drift of the machine (warming up, a neighbour) falls on
            # every variant alike instead of favouring whichever runs last
            for variant in (args.variants if rnd % 2 == 0 else args.variants[::-1]):
                if variant == "final" and (rnd > 0 or size != args.batch[0]):
                    continue  # one final state is enough: its write is what is measured
                block = Block(args.warmup, args.steps, sync)
                total = args.warmup + args.steps + 1
                if not args.process_peak:
                    _hwm_reset()
                extra: dict[str, Any] = {}
                if variant == "plain":
                    kwargs = {"device_id": device} if cuda else {}
                    dist.init_process_group(backend, store=dist.PrefixStore(f"plain-{rnd}-{size}", store),
                                            rank=rank, world_size=world, timeout=timedelta(seconds=120), **kwargs)
                    net = DDP(model, device_ids=[rank] if cuda else None)
                    for _ in range(total):
                        block.tick()
                        one_step(net, step_no, size)
                        step_no += 1
                    del net
                    dist.destroy_process_group()
                else:
                    os.environ[E.RT_JOB_TOKEN] = f"{variant}-{rnd}-{size}"  # each block its own keys
                    every = {"sup": None, "final": None, "snap1": 1, "snap10": 10, "ordered": None}[variant]
                    sup = rt.Supervisor(rt.SupervisorConfig(steps=step_no + total, write_final=variant == "final",
                                                            snapshot_every=every,
                                                            force_reduction=args.force_reduction,
                                                            ordered_reduction=variant == "ordered"))
                    net = sup.ddp(model, device_ids=[rank] if cuda else None)
                    state = rt.TrainState(model=model, optimizer=optimizer, step=step_no)

                    def train_step(ctx: rt.StepContext) -> torch.Tensor:
                        block.tick()
                        return one_step(net, ctx.step, size)

                    sup.run(train_step, state)
                    end = time.perf_counter()
                    step_no = state.step
                    reducer = sup._ddps[0][1]
                    if reducer is not None:
                        extra["copied_buckets"] = reducer.copied_buckets
                        extra["buckets"] = len(reducer.plan)
                        extra["native"] = reducer.native
                    if variant == "final":
                        extra["final_s"] = end - block.t1  # the last step, then the final state streamed to disk
                    if sup.snapshot is not None and cuda:
                        extra["snapshot_copy_s"] = sup.snapshot.snapshot.copy_seconds()
                        extra["snapshot_gib"] = sup.snapshot.snapshot.nbytes() / 2**30
                results.append({"round": rnd, "batch": size, "variant": variant, "step_s": block.step_s,
                                **_mem(), **extra})
                if rank == 0 and not args.quiet:
                    print(f"  round {rnd} batch {size} {variant:<7} {block.step_s * 1e3:8.2f} ms/step "
                          f"(host peak {results[-1].get('VmHWM', 0):.2f} GiB)", flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"results": results, "params": nparams, "args": vars(args),
                                              "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                                              "torch": torch.__version__}))


def summarize(data: dict[str, Any]) -> str:
    rows = ["| batch | variant | step (median) | ratio to plain | host peak | ratio | notes |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    res = data["results"]
    for size in sorted({r["batch"] for r in res}):
        by = {v: [r for r in res if r["batch"] == size and r["variant"] == v] for v in VARIANTS}
        base = statistics.median(r["step_s"] for r in by["plain"]) if by["plain"] else None
        base_mem = by["plain"][0].get("VmHWM", 0) if by["plain"] else None
        for v, rs in by.items():
            if not rs:
                continue
            step = statistics.median(r["step_s"] for r in rs)
            # The first block of each variant: a snapshot's pinned buffers stay with the process after its block.
            mem = rs[0].get("VmHWM", 0)
            notes = ""
            if "snapshot_copy_s" in rs[-1] and rs[-1]["snapshot_copy_s"] is not None:
                notes = (f"snapshot {rs[-1]['snapshot_gib']:.1f} GiB, side-stream copy "
                         f"{rs[-1]['snapshot_copy_s'] * 1e3:.0f} ms")
            if "final_s" in rs[0]:
                notes = f"final state written in {rs[0]['final_s']:.1f} s (host peak includes it)"
            if "buckets" in rs[0]:
                copied = sum(r.get("copied_buckets", 0) for r in rs)
                how = "reduced by DDP itself, no hook" if rs[0].get("native") else "through the hook"
                notes += ("; " if notes else "") + (f"{rs[0]['buckets']} buckets {how}, none copied" if not copied
                                                    else f"{copied} DDP buckets copied into the plan")
            ratio = f"{step / base:.3f}x" if base else "-"
            mratio = f"{mem / base_mem:.2f}x" if base_mem else "-"
            rows.append(f"| {size} | {v} | {step * 1e3:.1f} ms | {ratio} | {mem:.2f} GiB | {mratio} | {notes} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="20m")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--nproc", type=int, default=1, help="ranks (one GPU each on cuda)")
    p.add_argument("--batch", type=int, nargs="+", default=[8], help="sequences per rank per step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each block")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank on CPU")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument("--autocast", choices=["none", "bf16"], default="none", help="forward under bf16 autocast")
    p.add_argument("--process-peak", action="store_true",
                   help="never reset the peak: the host peak is the whole process's, start-up included (run one "
                        "variant per process to compare whole runs)")
    p.add_argument("--force-reduction", action="store_true",
                   help="the supervised variants take the world>1 path (hook, plan, vote all-reduce) at one rank too")
    p.add_argument("--item-every", type=int, default=0,
                   help="read the loss back (loss.item()) every N steps, as a loop that logs it does (0: never)")
    p.add_argument("--out", default=None, help="write the raw results as JSON here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.nproc < 1 or args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--nproc, --rounds and --steps must be >= 1, --warmup >= 0")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        p.error(f"--nproc {args.nproc} needs as many GPUs; {torch.cuda.device_count()} here")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    out = args.out or tempfile.mktemp(suffix=".json", prefix="steady-")
    print(f"steady_overhead: {args.preset} GPT, {args.nproc} rank(s) on {args.device}, batch {args.batch}, "
          f"{args.rounds} rounds x {args.variants}, {args.warmup}+{args.steps} steps a block, "
          f"loss.item() every {args.item_every or 'never'}, autocast {args.autocast}"
          f"{', forced world>1 path' if args.force_reduction else ''}", flush=True)
    if args.nproc == 1:
        _rank_main(0, 1, master.port, args, out)
    else:
        mp.start_processes(_rank_main, args=(args.nproc, master.port, args, out), nprocs=args.nproc,
                           start_method="spawn")
    data = json.loads(Path(out).read_text())
    print(f"\n{data['params'] / 1e6:.0f}M parameters, {data['device']}, torch {data['torch']}")
    print(summarize(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
