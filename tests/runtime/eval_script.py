"""examples/train_gpt.py with an evaluation inside the step, as real loops have one.

EVAL_EVERY=N: every N steps (not at step 0), forward passes on held-out batches for EVAL_S seconds, in eval
mode and without gradients, on every rank or (EVAL_RANK=0) on rank 0 alone while the others wait for it in the
step's all-reduce. It changes nothing the training computes: the final state is the one without it.
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_gpt  # noqa: E402

EVERY, SECONDS = int(os.environ["EVAL_EVERY"]), float(os.environ["EVAL_S"])
ONLY = os.environ.get("EVAL_RANK")


def evaluate(ctx, model) -> None:
    if ctx.step == 0 or ctx.step % EVERY or (ONLY is not None and ctx.rank != int(ONLY)):
        return
    held_out = torch.Generator().manual_seed(12345)  # its own stream: the training RNGs are not touched
    model.eval()
    batches, end = 0, time.monotonic() + SECONDS
    with torch.no_grad():
        while time.monotonic() < end:
            idx = torch.randint(256, (4, 16), generator=held_out)
            model(idx, idx)
            batches += 1
    model.train()
    print(f"eval at step {ctx.step} on rank {ctx.rank}: {batches} batches", flush=True)


if __name__ == "__main__":
    sys.exit(train_gpt.main(before_step=evaluate))
