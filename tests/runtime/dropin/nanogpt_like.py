"""A script shaped like karpathy/nanoGPT's train.py: plain DDP, its own checkpoint file, no resilient_train.

    torchrun --standalone --nproc_per_node=2 nanogpt_like.py OUT_DIR

It resumes from OUT_DIR/ckpt.pt when that exists (init_from = 'resume'), writes
it every EVAL_INTERVAL iterations, and saves the final weights to
OUT_DIR/final.pt. With PAUSE_RANK set, that rank of the first attempt writes
OUT_DIR/paused once it has saved a checkpoint and waits there (for the test to
SIGKILL it). MAX_ITERS overrides the length; with STEP_LOG set, rank 0 appends
"time iteration attempt" there each iteration (bench/dropin.py reads it).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

MAX_ITERS = int(os.environ.get("MAX_ITERS", "30"))
EVAL_INTERVAL = 10
BATCH, BLOCK, VOCAB, D = 4, 16, 64, 32


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.block = nn.TransformerEncoderLayer(D, 2, 4 * D, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, targets):
        logits = self.head(self.block(self.emb(idx)))
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def get_batch(it, rank):
    g = torch.Generator().manual_seed(1000 * it + rank)  # the data depends on the iteration only
    x = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g)
    return x, torch.roll(x, -1, dims=1)


if __name__ == "__main__":
    out_dir = sys.argv[1]
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group(backend="gloo")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        rank, world = 0, 1
    master = rank == 0
    torch.manual_seed(1337)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    iter_num = 0
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    if os.path.exists(ckpt_path):  # init_from = 'resume'
        checkpoint = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_num = checkpoint["iter_num"]
        if master:
            print(f"resuming from iteration {iter_num}", flush=True)
    if ddp:
        model = DDP(model)
    raw = model.module if ddp else model
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    while iter_num < MAX_ITERS:
        if iter_num % EVAL_INTERVAL == 0 and iter_num > 0 and master:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}, tmp)
            os.replace(tmp, ckpt_path)
        if ddp:
            dist.barrier()  # the checkpoint is on disk before anyone goes on
        if (attempt == 0 and os.environ.get("PAUSE_RANK") == str(rank) and iter_num == EVAL_INTERVAL + 2):
            open(os.path.join(out_dir, "paused"), "w").close()
            time.sleep(120)  # SIGKILLed here by the test
        if master and os.environ.get("STEP_LOG"):
            with open(os.environ["STEP_LOG"], "a") as log:
                log.write(f"{time.time()} {iter_num} {attempt}\n")
        x, y = get_batch(iter_num, rank)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        iter_num += 1
    if master:
        torch.save(raw.state_dict(), os.path.join(out_dir, "final.pt"))
        print(f"done at iteration {iter_num}, attempt {attempt}", flush=True)
    if ddp:
        # Not in nanoGPT: a rank destroying its gloo group while a peer still saves sometimes aborts in
        # torch 2.13 ("terminate called without an active exception", under torchrun too), outside the test.
        dist.barrier()
        dist.destroy_process_group()
