"""One rank of a checkpointing test job: a real process with a real store and gloo group.

Prints one JSON line per save (``{"step", "phase", "error"}``) and, in load mode,
one line describing what it loaded. Faults come from the environment
(``RESILIENT_TRAIN_CKPT_KILL_AT``) or from ``--fsize-limit``.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from checkpointing import CheckpointConfig, CheckpointManager, diff_states
from ckpt_helpers import rank_state
from monitors.events import EventLog


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--save", default="", help="comma-separated steps to save")
    p.add_argument("--scales", default="", help="comma-separated state scales per saved step")
    p.add_argument("--load", action="store_true")
    p.add_argument("--fsize-limit", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    if args.fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False, timeout=timedelta(seconds=180))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=args.rank, world_size=args.world,
        timeout=timedelta(seconds=180),
    )
    config = CheckpointConfig(directory=args.dir, keep_last=10, local_keys=("rng",), timeout_s=args.timeout, run_id="test-run")
    events = EventLog(args.events, source=f"rank{args.rank}")
    with CheckpointManager(
        config, rank=args.rank, world_size=args.world, store=dist.PrefixStore("ck", store), events=events
    ) as mgr:
        if args.load:
            state, manifest = mgr.load()
            expected = rank_state(manifest.step, args.rank)
            if args.rank >= manifest.world_size:
                del expected["rng"]  # no saved rank with this id: the caller re-seeds
            # Training continues on the new world size: one data-parallel step, then a save.
            w = state["model"]["layer.weight"]
            grad = torch.full_like(w, float(args.rank + 1))
            dist.all_reduce(grad)
            result = {
                "loaded": manifest.step,
                "saved_world_size": manifest.world_size,
                "diff": diff_states(state, expected),
                "has_rng": "rng" in state,
            }
            state["model"]["layer.weight"] = w - 0.1 * grad / args.world
            state["rng"] = torch.zeros(32, dtype=torch.uint8) + args.rank
            h = mgr.save(manifest.step + 1, state, blocking=True)
            result["next_save"] = h.phase.value
            print(json.dumps(result), flush=True)
        scales = [int(s) for s in args.scales.split(",")] if args.scales else []
        for i, step in enumerate(int(s) for s in args.save.split(",") if s):
            scale = scales[i] if i < len(scales) else 1
            h = mgr.save(step, rank_state(step, args.rank, scale=scale), extras={"step": step})
            h.wait(args.timeout)
            print(json.dumps({"step": step, "phase": h.phase.value, "error": h.error}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
