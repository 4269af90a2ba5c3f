"""One rank of a job whose generations the test drives, as the agent and the supervisor would.

It saves the steps of ``--plan`` through a CheckpointManager coordinated on generation g's keys
(``gen/{g}/ckpt``) and cancelled by the store key ``fault/{g}`` (what the agent sets when it declares
the generation failed). A save that comes back cancelled moves the rank to generation g+1, where it
saves the next planned step. Before saving in a generation, it prints ``{"ready": g}`` and waits for
``gen/{g}/start`` (the rendezvous). One JSON line per save: step, phase, error, generation.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta

import torch.distributed as dist

from checkpointing import CheckpointConfig, CheckpointManager
from ckpt_helpers import rank_state
from monitors.events import EventLog


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--generation", type=int, default=0)
    p.add_argument("--plan", required=True, help="comma-separated steps to save")
    p.add_argument("--timeout", type=float, required=True)
    args = p.parse_args()
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=120))
    gen = args.generation

    def coordination(g: int):  # the generation's keys, and "the store knows the generation moved"
        return dist.PrefixStore(f"gen/{g}/ckpt", store), (lambda: store.check([f"fault/{g}"]))

    def rendezvous(g: int) -> None:
        print(json.dumps({"ready": g}), flush=True)
        store.wait([f"gen/{g}/start"], timedelta(seconds=120))

    config = CheckpointConfig(directory=args.dir, keep_last=10, local_keys=("rng",), timeout_s=args.timeout,
                              in_flight="skip")
    keys, cancelled = coordination(gen)
    mgr = CheckpointManager(config, rank=args.rank, world_size=args.world, store=keys, cancelled=cancelled,
                            events=EventLog(args.events, source=f"rank{args.rank}"))
    rendezvous(gen)
    for step in (int(s) for s in args.plan.split(",")):
        h = mgr.save(step, rank_state(step, args.rank))
        phase = h.wait(args.timeout)
        print(json.dumps({"step": step, "phase": phase.value, "error": h.error, "generation": gen}), flush=True)
        if h.error is not None and "cancelled" in h.error:
            gen += 1
            keys, cancelled = coordination(gen)
            mgr.set_store(keys, cancelled=cancelled)
            rendezvous(gen)
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
