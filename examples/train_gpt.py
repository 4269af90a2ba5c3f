"""A small GPT trained data-parallel under the resilient-train supervisor.

Every batch is a function of (seed, step, rank), so any step can be replayed
exactly. Runs alone, under ``resilient-train run`` and under plain ``torchrun``:

    python examples/train_gpt.py --steps 50
    resilient-train run --nproc-per-node 4 --run-dir runs/demo examples/train_gpt.py --steps 200
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 examples/train_gpt.py --steps 50
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from monitors.cupti_kernels import CuptiConfig, unavailable_reason
import resilient_train as rt
from resilient_train.rank.disk import default_checkpoint_config
from resilient_train.rank.rerun import OnGenuine, RerunConfig, RerunMode


@dataclass(kw_only=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.heads = cfg.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def batch(seed: int, step: int, rank: int, *, size: int, cfg: GPTConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of a toy language (an affine recurrence with noise)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    n = cfg.seq_len + 1
    start = torch.randint(cfg.vocab, (size, 1), generator=g)
    steps = torch.arange(n).view(1, n)
    clean = (start * 31 + steps * 7) % cfg.vocab
    noise = torch.randint(cfg.vocab, (size, n), generator=g)
    keep = torch.rand(size, n, generator=g) > 0.1
    seq = torch.where(keep, clean, noise).to(device)
    return seq[:, :-1], seq[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="disk checkpoint interval in steps, under RUN_DIR/checkpoints (0: none, or the run config's "
                        "checkpoint section: --checkpoint.interval=N; needs a run dir)")
    p.add_argument("--ckpt-mode", choices=["process", "disabled"], default="process",
                   help="process: saves are written by a background process (default); disabled: saves block")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps on rank 0 (0: never)")
    p.add_argument("--rerun-mode", choices=[m.value for m in RerunMode], default=None,
                   help="validate each step's results and re-run rejected steps (default: the run config's "
                        "rerun.mode, disabled)")
    p.add_argument("--rerun-on-genuine", choices=[m.value for m in OnGenuine], default=None,
                   help="a genuine numerical event: skip the batch, or save and stop with exit code 17 (default: the "
                        "run config's rerun.on_genuine, skip)")
    p.add_argument("--reproducible", action="store_true",
                   help="deterministic algorithms and one intra-op thread: bitwise-reproducible runs")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="a host snapshot of the model and optimizer every N steps (default 0: none; "
                        "live replicas are the redundancy)")
    p.add_argument("--preempt-grace", type=float, default=None,
                   help="seconds from a preemption signal to the ranks' exit, its checkpoint included (default: "
                        "60, or three times the longest save so far, whichever is longer; the agent follows it)")
    p.add_argument("--cupti-every", type=int, default=0,
                   help="NVRx's CUPTI kernel straggler scores every N steps, as events "
                        "(needs the nvrx extra and CUDA; default 0: off)")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error("--steps must be >= 0")
    if args.snapshot_every < 0:
        p.error("--snapshot-every must be >= 0")
    if args.cupti_every < 0:
        p.error("--cupti-every must be >= 0")
    try:
        preemption = rt.PreemptionConfig(grace_s=args.preempt_grace)
    except ValueError as e:
        p.error(f"--preempt-grace: {e}")
    args.preemption = preemption
    if args.cupti_every and (why := unavailable_reason()):
        p.error(f"--cupti-every: {why}")
    return args


def main(argv: list[str] | None = None, *,
         before_step: Callable[[rt.StepContext, nn.Module], None] | None = None) -> int:
    """``before_step(ctx, model)``: what a loop does at the start of a step besides training (an evaluation
    every N steps, say); it must leave the training state as it found it."""
    args = parse_args(argv)
    cfg = GPTConfig(d_model=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    run_dir = rt.WorkerEnv.from_environ().run_dir
    # Only what this script's flags set is passed: a field left out comes from the run config under
    # `resilient-train run` (--config FILE, --checkpoint.interval=N, ...), else from its default
    # (SupervisorConfig.from_run_config). A field passed wins over the run config, and the runtime says so once.
    own: dict = {}
    if args.ckpt_every and run_dir:
        own["checkpoint"] = default_checkpoint_config(run_dir, args.ckpt_every, mode=args.ckpt_mode)
    rerun = {k: v for k, v in (("mode", args.rerun_mode), ("on_genuine", args.rerun_on_genuine)) if v is not None}
    if rerun:
        own["rerun"] = RerunConfig(**rerun)
    if args.cupti_every:
        own["cupti"] = CuptiConfig(report_every_steps=args.cupti_every)
    if args.snapshot_every:
        own["snapshot_every"] = args.snapshot_every
    if args.preempt_grace is not None:
        own["preemption"] = args.preemption
    if args.reproducible:
        own["reproducible"] = True
    sup = rt.Supervisor(rt.SupervisorConfig.from_run_config(steps=args.steps, **own))
    if sup.env.replacement:
        # A replacement takes its weights from a peer: skip initialisation.
        with torch.device("meta"):
            model = GPT(cfg)
        model = model.to_empty(device=sup.device)
    else:
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = GPT(cfg).to(sup.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Each rank its own dropout stream; every RNG the job uses is seeded, so a run is a function of its
    # arguments (the supervisor restores them all). sup.seed seeds each logical rank of an elastic job too.
    sup.seed(args.seed)
    state = rt.TrainState(model=model, optimizer=optimizer)

    def train_step(ctx: rt.StepContext) -> torch.Tensor:
        if before_step is not None:
            before_step(ctx, model)
        ctx.enter("data")
        # data_rank, not rank: a healthy peer re-running a suspect rank's step computes that rank's batch.
        x, y = batch(args.seed, ctx.step, ctx.data_rank, size=args.batch, cfg=cfg, device=ctx.device)
        ctx.enter("forward")
        loss = ctx.loss(model(x, y))  # the rerun validators check it
        ctx.enter("backward")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ctx.average_gradients()
        ctx.enter("optimizer")
        optimizer.step()
        if ctx.rank == 0 and args.log_every and (ctx.step + 1) % args.log_every == 0:
            print(f"step {ctx.step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
        return loss.detach()

    sup.run(train_step, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
