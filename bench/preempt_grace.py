"""What does a preemption's checkpoint need from its grace? (CPU, one process)

The worst case a grace must cover: the signal arrives just as a periodic async
save was requested, so the preemption's save first waits for that one (a save
in flight), then writes its own (``required=True``, as the Supervisor does).
For each state size this measures, with ``checkpointing.CheckpointManager``
(the writer process the Supervisor uses):

- ``cold``: the writer started at restore (``prepare``) and the first save
  requested at once (its import of torch is part of the save in flight);
- ``warm``: the same two saves once the writer is up;
- ``one``: a single save, request to commit (what the default grace is grown
  from: ``resilient_train.protocol.shutdown.auto_grace`` takes twice the longest, and half
  again for slack).

Sizes: the GPT example's own state at its default size (model and AdamW's two
moments) and larger synthetic ones. Prints the seconds and the default grace the
job would get after its first save, against the 60 s floor.
Run: ``python bench/preempt_grace.py [--gb 0.5 2] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpointing import CheckpointConfig, CheckpointManager  # noqa: E402
from checkpointing.tree import leaves  # noqa: E402
from resilient_train.protocol.shutdown import DEFAULT_GRACE_S, auto_grace  # noqa: E402


def example_state() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from train_gpt import GPT, GPTConfig

    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(256, (2, 64))
    model(x, x).backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def synthetic_state(gb: float) -> dict:
    n = 48
    numel = int(gb * 2**30 / 4 / 3 / n)  # model and two moments, fp32
    shape = (max(1, numel // 1024), 1024)
    return {g: {f"t{i}": torch.randn(shape) for i in range(n)} for g in ("model", "exp_avg", "exp_avg_sq")}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in leaves(state) if isinstance(t, torch.Tensor))


def in_flight_then_required(mgr: CheckpointManager, state: dict, step: int) -> float:
    """A periodic save requested, then at once the preemption's (which waits for it): seconds to its commit."""
    t0 = time.perf_counter()
    mgr.save(step, state)
    handle = mgr.save(step + 1, state, required=True)
    handle.wait(600)
    return time.perf_counter() - t0


def one_save(mgr: CheckpointManager, state: dict, step: int) -> float:
    t0 = time.perf_counter()
    mgr.save(step, state).wait(600)
    return time.perf_counter() - t0


def measure(name: str, state: dict, repeats: int) -> None:
    cold, warm, one = [], [], []
    for _ in range(repeats):
        root = Path(tempfile.mkdtemp(prefix="rt-grace-"))
        try:
            mgr = CheckpointManager(CheckpointConfig(directory=root, keep_last=1, timeout_s=600))
            mgr.prepare(state)  # as the Supervisor does at restore: the writer's imports begin
            cold.append(in_flight_then_required(mgr, state, 10))
            warm.append(in_flight_then_required(mgr, state, 20))
            one.append(one_save(mgr, state, 30))
            mgr.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    longest = max(one)
    print(f"{name:>22} | {nbytes(state) / 2**20:9.1f} | {statistics.median(cold):6.2f} | "
          f"{statistics.median(warm):6.2f} | {statistics.median(one):6.2f} | {auto_grace(longest):6.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, nargs="*", default=[0.5, 2.0], help="synthetic state sizes (GiB)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"default grace floor: {DEFAULT_GRACE_S:g} s; seconds, median of {args.repeats}")
    print(f"{'state':>22} | {'MiB':>9} | {'cold':>6} | {'warm':>6} | {'one':>6} | grace")
    measure("examples/train_gpt.py", example_state(), args.repeats)
    for gb in args.gb:
        measure(f"synthetic {gb:g} GiB", synthetic_state(gb), args.repeats)


if __name__ == "__main__":
    main()
