"""A plain torchrun script: env:// init, all-reduces for SECONDS, a result file per rank and attempt.

With KILL_RANK set, that rank SIGKILLs itself at iteration 20 of the first
attempt; with HANG_RANK set, that rank sleeps there instead. With STEP_LOG set,
rank 0 appends "time iteration attempt" there each iteration (bench/dropin.py).
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def main(beat=None):
    out, seconds = sys.argv[1], float(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    end = time.monotonic() + seconds
    it = 0
    while True:
        t = torch.ones(1)
        dist.all_reduce(t)
        done = torch.tensor([float(time.monotonic() >= end)])
        dist.all_reduce(done)  # every rank stops at the same iteration
        if done.item() > 0:
            break
        if beat is not None:
            beat(it)
        if rank == 0 and os.environ.get("STEP_LOG"):
            with open(os.environ["STEP_LOG"], "a") as log:
                log.write(f"{time.time()} {it} {attempt}\n")
        if attempt == 0 and it == 20 and os.environ.get("KILL_RANK") == str(rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 0 and it == 20 and os.environ.get("HANG_RANK") == str(rank):
            time.sleep(300)
        it += 1
        time.sleep(0.01)
    with open(os.path.join(out, f"rank{rank}.attempt{attempt}"), "w") as f:
        f.write(f"{t.item()} {world} {os.environ['MASTER_PORT']} {it}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
