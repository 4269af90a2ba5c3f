"""One rank saving onto a small filesystem that fills up: what does each save and the final write say?

Prints one JSON line per planned save (its phase and error, or the DiskFullError that save() raised),
then, on rank 0, the outcome of writing a final state too large for the filesystem.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta

import torch.distributed as dist

from checkpointing import CheckpointConfig, CheckpointManager, DiskFullError, is_disk_full, write_state
from ckpt_helpers import rank_state
from monitors.events import EventLog


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--final", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--scales", required=True, help="comma-separated state scale per save (steps 1, 2, ...)")
    args = p.parse_args()
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=120))
    config = CheckpointConfig(directory=args.dir, keep_last=10, local_keys=("rng",), timeout_s=120)
    with CheckpointManager(config, rank=args.rank, world_size=args.world, store=dist.PrefixStore("ck", store),
                           events=EventLog(args.events, source=f"rank{args.rank}")) as mgr:
        for step, scale in enumerate((int(s) for s in args.scales.split(",")), start=1):
            try:
                h = mgr.save(step, rank_state(step, args.rank, scale=scale))
            except DiskFullError as e:
                print(json.dumps({"step": step, "raised": type(e).__name__, "error": str(e)}), flush=True)
                continue
            h.wait(120)
            print(json.dumps({"step": step, "phase": h.phase.value, "error": h.error, "disk_full": h.disk_full}),
                  flush=True)
    if args.rank == 0:
        try:
            write_state(args.final, rank_state(9, 0, scale=400), step=9)
            print(json.dumps({"final": "written"}), flush=True)
        except OSError as e:
            print(json.dumps({"final": type(e).__name__, "error": str(e), "disk_full": is_disk_full(e)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
