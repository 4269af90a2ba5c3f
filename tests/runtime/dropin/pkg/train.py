"""Run as ``-m pkg.train OUT``: one all-reduce, a result file."""

import os
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as f:
        f.write(f"{t.item()} {__name__} {os.environ.get('OMP_NUM_THREADS')}")
    dist.destroy_process_group()
