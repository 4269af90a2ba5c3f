"""How long is the training loop blocked per checkpoint save? (CPU, one process)

One state sized like a 100M-parameter model trained with Adam (parameters,
gradients, two moments: about 1.6 GB of fp32), saved several times with:

- ``floor``: one copy of the state into a preallocated buffer (the least any
  save that lets training continue can block);
- ``dcp.save``: synchronous torch.distributed.checkpoint;
- ``dcp.async_save`` with a thread and with a process (default staging);
- ``ours``: ``checkpointing.CheckpointManager.save`` (stage into reused memfd
  buffers, a persistent writer process writes, commit in the background).

The blocked time is the time the call takes to return; before the next save we
wait for the previous one to be durable (not counted). Medians over the saves
after the first (the first is printed separately: it allocates buffers or
starts processes). On a GPU (``--device cuda``) the state lives on the GPU, the
floor is the device-to-host copy into pinned memory, and every blocked time
includes a ``torch.cuda.synchronize()``.
Run: ``python bench/checkpoint_stall.py [--gb 1.6] [--saves 4] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpointing import CheckpointConfig, CheckpointManager, SavePhase  # noqa: E402


def make_state(gb: float, device: str) -> dict[str, dict[str, torch.Tensor]]:
    per_group = int(gb * 2**30 / 4 / 4)  # fp32 elements in each of the four groups
    n_tensors = 48
    numel = per_group // n_tensors
    shape = (numel // 1024, 1024)
    groups = {}
    for group in ("model", "grads", "exp_avg", "exp_avg_sq"):
        groups[group] = {f"layer{i}": torch.randn(shape, device=device) for i in range(n_tensors)}
    return groups


def timed_saves(name: str, saves: int, save_once) -> list[float]:
    blocked = []
    for i in range(saves):
        t0 = time.perf_counter()
        finish = save_once(i)
        if torch.cuda.is_available():
            # On GPU the next kernel queues behind any copy still in flight: count it as blocked.
            torch.cuda.synchronize()
        blocked.append(time.perf_counter() - t0)
        if finish is not None:
            finish()
    print(f"  {name}: " + ", ".join(f"{b:.3f}" for b in blocked), flush=True)
    return blocked


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.6)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir on the disk of /tmp)")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-stall-"))
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    state = make_state(args.gb, args.device)
    nbytes = sum(t.numel() * t.element_size() for g in state.values() for t in g.values())
    print(f"state: {nbytes / 1e9:.2f} GB in {sum(len(g) for g in state.values())} tensors; "
          f"{torch.get_num_threads()} torch threads; writing under {root}", flush=True)
    results: dict[str, list[float]] = {}

    def host_buffers() -> dict[str, dict[str, torch.Tensor]]:
        pin = args.device == "cuda"  # the device-to-host floor copies into pinned memory
        return {g: {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in ts.items()} for g, ts in state.items()}

    floor_buf = host_buffers()

    def floor(_: int):
        nonlocal floor_buf
        for g, ts in state.items():
            for k, t in ts.items():
                floor_buf[g][k].copy_(t, non_blocking=True)
        return None

    results["floor (copy into preallocated buffer)"] = timed_saves("floor", args.saves, floor)
    floor_buf = {}

    def fresh(name: str) -> Path:
        d = root / name
        shutil.rmtree(d, ignore_errors=True)
        return d

    def sync_save(i: int):
        dcp.save(state, checkpoint_id=str(fresh("sync")))
        return lambda: shutil.rmtree(root / "sync", ignore_errors=True)

    results["dcp.save"] = timed_saves("dcp.save", args.saves, sync_save)

    def async_with(kind: AsyncCheckpointerType):
        def once(i: int):
            fut = dcp.async_save(state, checkpoint_id=str(fresh(kind.value)), async_checkpointer_type=kind)

            def finish() -> None:
                fut.result(timeout=600)
                shutil.rmtree(root / kind.value, ignore_errors=True)  # disk space for large states

            return finish

        return once

    results["dcp.async_save (thread)"] = timed_saves("async thread", args.saves, async_with(AsyncCheckpointerType.THREAD))
    results["dcp.async_save (process)"] = timed_saves("async process", args.saves, async_with(AsyncCheckpointerType.PROCESS))

    mgr = CheckpointManager(CheckpointConfig(directory=root / "ours", keep_last=1, timeout_s=600))

    def ours(i: int):
        h = mgr.save(i + 1, state)

        def finish() -> None:
            assert h.wait(600) == SavePhase.COMMITTED, h.error

        return finish

    results["ours (CheckpointManager.save)"] = timed_saves("ours", args.saves, ours)
    mgr.close()
    floor_buf = host_buffers()
    # The floor again, last: the machine is in the same state (page cache, memory) as for the others.
    results["floor, measured again last"] = timed_saves("floor again", args.saves, floor)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)

    def steady(v: list[float]) -> float:
        return statistics.median(v[1:]) if len(v) > 1 else v[0]

    floor_s = min(steady(results["floor (copy into preallocated buffer)"]), steady(results["floor, measured again last"]))
    async_s = min(steady(results["dcp.async_save (thread)"]), steady(results["dcp.async_save (process)"]))
    print()
    print("| method | first save blocked (s) | steady blocked, median (s) | x floor (lower of the two) | x best dcp.async_save |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, v in results.items():
        s = steady(v)
        print(f"| {name} | {v[0]:.3f} | {s:.3f} | {s / floor_s:.2f} | {s / async_s:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
