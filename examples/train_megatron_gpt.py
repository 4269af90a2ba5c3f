"""A Megatron-Core GPT trained data-parallel under the resilient-train supervisor (TP = PP = 1).

Megatron's parallel state is rebuilt on every generation's process group
(``resilient_train.integrations.megatron``): the model is built once, with the
integration's process-group collection, and its modules are pointed at each
new generation's groups. Two models:

* ``--arch gpt``: ``GPTModel`` with Megatron's local layer spec. Needs CUDA
  (Megatron's attention takes its buffers from a CUDA memory pool).
* ``--arch mlp``: a language model of Megatron's tensor-parallel layers only
  (``VocabParallelEmbedding``, ``ColumnParallelLinear``, ``RowParallelLinear``),
  which also runs on CPU with gloo: the CPU tests use it.

Every batch is a function of (seed, step, rank), so any step can be replayed::

    resilient-train run --nproc-per-node 2 --run-dir runs/mgpt examples/train_megatron_gpt.py --arch mlp --steps 50
    python examples/train_megatron_gpt.py --arch gpt --steps 50 --plain     # the same loop without the supervisor
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# megatron-core warns on import that Transformer Engine and Apex are absent (it falls back to its own kernels).
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


@dataclass(kw_only=True)
class ModelArgs:
    arch: str
    vocab: int
    seq_len: int
    hidden: int
    layers: int
    heads: int


def transformer_config(m: ModelArgs, device: torch.device) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    # CPU initialisation: the same weights whatever the device, from torch's CPU generator (seeded by the script).
    return TransformerConfig(num_layers=m.layers, hidden_size=m.hidden, num_attention_heads=m.heads,
                             use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                             perform_initialization=True, bf16=False, params_dtype=torch.float32)


class MegatronMLPLM(nn.Module):
    """Embedding, residual MLP blocks of Megatron's tensor-parallel linears, and an output layer."""

    def __init__(self, m: ModelArgs, config: Any, groups: Any) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        init = config.init_method
        self.embed = VocabParallelEmbedding(m.vocab, m.hidden, init_method=init, config=config, tp_group=groups.tp)
        self.norms = nn.ModuleList(nn.LayerNorm(m.hidden) for _ in range(m.layers))
        self.up = nn.ModuleList(
            ColumnParallelLinear(m.hidden, 4 * m.hidden, config=config, init_method=init, bias=True,
                                 gather_output=False, tp_group=groups.tp) for _ in range(m.layers))
        self.down = nn.ModuleList(
            RowParallelLinear(4 * m.hidden, m.hidden, config=config, init_method=init, bias=True,
                              input_is_parallel=True, skip_bias_add=False, tp_group=groups.tp)
            for _ in range(m.layers))
        self.head = ColumnParallelLinear(m.hidden, m.vocab, config=config, init_method=init, bias=False,
                                         gather_output=True, tp_group=groups.tp)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for norm, up, down in zip(self.norms, self.up, self.down):
            h, _ = up(norm(x))
            h, _ = down(F.gelu(h))
            x = x + h
        logits, _ = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class GPTLoss(nn.Module):
    """Megatron's GPTModel (local spec), returning the mean token loss."""

    def __init__(self, m: ModelArgs, config: Any, groups: Any) -> None:
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

        self.gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=m.vocab,
                            max_sequence_length=m.seq_len, pg_collection=groups)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        return self.gpt(tokens, pos, None, labels=labels).float().mean()


def build_model(m: ModelArgs, groups: Any, device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    if device.type == "cuda":
        from resilient_train.integrations.megatron.rng import seed_rng_tracker

        seed_rng_tracker(seed)  # Megatron's attention forks its CUDA generators (TP = 1: tensor rank 0)
    config = transformer_config(m, device)
    model = (GPTLoss if m.arch == "gpt" else MegatronMLPLM)(m, config, groups)
    return model.to(device)


def batch(seed: int, step: int, rank: int, *, size: int, m: ModelArgs,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of a toy language (an affine recurrence with noise)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    n = m.seq_len + 1
    start = torch.randint(m.vocab, (size, 1), generator=g)
    clean = (start * 31 + torch.arange(n).view(1, n) * 7) % m.vocab
    keep = torch.rand(size, n, generator=g) > 0.1
    seq = torch.where(keep, clean, torch.randint(m.vocab, (size, n), generator=g)).to(device)
    return seq[:, :-1], seq[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=["gpt", "mlp"], default="gpt",
                   help="gpt: GPTModel, local spec (needs CUDA); mlp: Megatron's tensor-parallel layers (CPU too)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=0, help="print the loss every N steps on rank 0 (0: never)")
    p.add_argument("--reproducible", action="store_true",
                   help="deterministic algorithms and one intra-op thread: bitwise-reproducible runs")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="the supervisor's process-group backend (auto: nccl with CUDA; gloo runs --arch mlp on CPU)")
    p.add_argument("--plain", action="store_true",
                   help="the same loop without the supervisor (one process: the step-time baseline)")
    p.add_argument("--timing", default=None,
                   help="write {'steps': n, 'seconds': s} of the steps after --warmup to this JSON file (rank 0)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of --timing")
    args = p.parse_args(argv)
    if args.steps < 0 or args.warmup < 0:
        p.error("--steps and --warmup must be >= 0")
    if args.timing and args.warmup >= args.steps:
        p.error("--timing needs --steps > --warmup")
    return args


class _Timer:
    """Wall time of the steps after the warm-up, the device drained at both ends."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.t0: float | None = None
        self.t1: float | None = None

    def at(self, step: int) -> None:
        if self.args.timing and step == self.args.warmup and self.t0 is None:
            self._sync()
            self.t0 = time.perf_counter()

    def end(self, step: int) -> None:
        """At the end of each step: the last one stops the clock (what follows the loop is not a step:
        the supervisor's final state, a few GB for a large model, is written after it)."""
        if self.args.timing and step == self.args.steps - 1 and self.t0 is not None and self.t1 is None:
            self._sync()
            self.t1 = time.perf_counter()

    def write(self, rank: int) -> None:
        if self.args.timing and rank == 0 and self.t1 is not None:
            seconds = self.t1 - self.t0
            with open(self.args.timing, "w") as f:
                json.dump({"steps": self.args.steps - self.args.warmup, "seconds": seconds}, f)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def main_supervised(args: argparse.Namespace, m: ModelArgs) -> int:
    import resilient_train as rt
    from resilient_train.integrations import megatron as rtm

    sup = rt.Supervisor(rt.SupervisorConfig.from_run_config(  # the run config's, with what this script's flags set
        steps=args.steps, backend=args.backend, **({"reproducible": True} if args.reproducible else {})))
    parallel = rtm.attach(sup)  # TP = PP = 1: every rank a data-parallel replica
    model = build_model(m, parallel.groups, sup.device, args.seed)
    parallel.track(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.manual_seed(args.seed * 7919 + sup.env.rank)
    # Megatron's tracked CUDA generators belong to each step's rank-local state, beside torch's own.
    extra = None
    if sup.device.type == "cuda":
        from resilient_train.integrations.megatron.rng import RngTrackerState

        extra = RngTrackerState()
    state = rt.TrainState(model=model, optimizer=optimizer, extra=extra)
    timer = _Timer(args, sup.device)

    def train_step(ctx: rt.StepContext) -> torch.Tensor:
        timer.at(ctx.step)
        ctx.enter("data")
        x, y = batch(args.seed, ctx.step, ctx.data_rank, size=args.batch, m=m, device=ctx.device)
        ctx.enter("forward")
        loss = ctx.loss(model(x, y))
        ctx.enter("backward")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ctx.average_gradients()
        ctx.enter("optimizer")
        optimizer.step()
        timer.end(ctx.step)
        if ctx.rank == 0 and args.log_every and (ctx.step + 1) % args.log_every == 0:
            print(f"step {ctx.step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
        return loss.detach()

    sup.run(train_step, state)
    timer.write(sup.env.rank)
    return 0


def main_plain(args: argparse.Namespace, m: ModelArgs) -> int:
    """One process, Megatron's parallel state built once: what the supervisor is measured against."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if args.reproducible:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1,
                            **({"device_id": device} if device.type == "cuda" else {}))
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    model = build_model(m, ProcessGroupCollection.use_mpu_process_groups(), device, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.manual_seed(args.seed * 7919)
    timer = _Timer(args, device)
    for step in range(args.steps):
        timer.at(step)
        x, y = batch(args.seed, step, 0, size=args.batch, m=m, device=device)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        timer.end(step)
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    timer.write(0)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    m = ModelArgs(arch=args.arch, vocab=args.vocab, seq_len=args.seq_len, hidden=args.hidden, layers=args.layers,
                  heads=args.heads)
    if args.arch == "gpt" and (not torch.cuda.is_available() or args.backend == "gloo"):
        print("train_megatron_gpt.py: --arch gpt needs CUDA (Megatron's attention allocates from a CUDA "
              "buffer); use --arch mlp on CPU", file=sys.stderr)
        return 2
    return main_plain(args, m) if args.plain else main_supervised(args, m)


if __name__ == "__main__":
    sys.exit(main())
