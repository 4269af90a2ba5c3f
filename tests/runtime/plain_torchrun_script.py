"""An unmodified torchrun-style script: env:// init, one all-reduce, a result file.

With KILL_RANK set, that rank SIGKILLs itself in the first attempt.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 and os.environ.get("KILL_RANK") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{t.item()} {world} {os.environ['LOCAL_RANK']} {attempt}")
    dist.destroy_process_group()
