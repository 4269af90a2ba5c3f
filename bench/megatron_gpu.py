"""Megatron-Core on one GPU: the supervisor's step cost, and checkpoints through dist_checkpointing.

1. Step time of ``examples/train_megatron_gpt.py --arch gpt`` under ``resilient-train run``
   (one rank) against the same loop with ``--plain`` (no supervisor), interleaved.
2. ``dist_checkpointing.save`` alone against :class:`checkpointing.megatron_dist.MegatronCheckpointer`
   (the same save, then checksums, manifest and commit), its verification, a load
   compared bit for bit, and the fallback past a checkpoint with a flipped byte.
   ``--fixture DIR`` also writes a tiny model's committed checkpoints there as a
   tar.gz (the CPU tests verify and load it).

    python bench/megatron_gpu.py --out results.json [--fixture DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
EXAMPLE = REPO / "examples" / "train_megatron_gpt.py"
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def model_args(a: argparse.Namespace) -> list[str]:
    return ["--arch", a.arch, "--hidden", str(a.hidden), "--layers", str(a.layers), "--heads", str(a.heads),
            "--seq-len", str(a.seq_len), "--vocab", str(a.vocab), "--batch", str(a.batch)]


def step_ratio(a: argparse.Namespace, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    common = [*model_args(a), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    times: dict[str, list[float]] = {"plain": [], "supervised": []}
    for rep in range(a.reps):
        for kind in ("plain", "supervised"):
            timing = work / f"{kind}-{rep}.json"
            if kind == "plain":
                cmd = [sys.executable, str(EXAMPLE), *common, "--plain", "--timing", str(timing)]
            else:
                cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "1", "--run-dir",
                       str(work / f"run-{rep}"), str(EXAMPLE), *common, "--timing", str(timing)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
            if p.returncode != 0:
                raise SystemExit(f"{kind} run failed ({p.returncode}):\n{p.stderr[-3000:]}")
            t = json.loads(timing.read_text())
            times[kind].append(t["seconds"] / t["steps"])
            print(f"  {kind:10s} rep {rep}: {1000 * times[kind][-1]:.2f} ms/step", flush=True)
    best = {k: min(v) for k, v in times.items()}
    return {"ms_per_step": {k: [round(1000 * x, 3) for x in v] for k, v in times.items()},
            "ratio_best": round(best["supervised"] / best["plain"], 4),
            "ratio_per_rep": [round(s / p, 4) for s, p in zip(times["supervised"], times["plain"])]}


def checkpoints(a: argparse.Namespace, work: Path, fixture: Path | None) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    sys.path.insert(0, str(REPO / "examples"))
    from train_megatron_gpt import ModelArgs, build_model

    from checkpointing.megatron_dist import MegatronCheckpointConfig, MegatronCheckpointer

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    m = ModelArgs(arch="gpt", vocab=a.vocab, seq_len=a.seq_len, hidden=a.hidden, layers=a.layers, heads=a.heads)
    model = build_model(m, groups, torch.device("cuda", 0), 0).gpt
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values() if torch.is_tensor(p))
    out: dict = {"state_bytes": nbytes}

    plain = []
    for i in range(2):
        d = work / f"plain-{i}"
        d.mkdir()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist_checkpointing.save(model.sharded_state_dict(), str(d))
        plain.append(time.perf_counter() - t0)
    out["dist_checkpointing_save_s"] = [round(x, 4) for x in plain]

    ck = MegatronCheckpointer(MegatronCheckpointConfig(directory=work / "ckpt", keep_last=3, console=False))
    ours = []
    for step in (1, 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ck.save(step, model.sharded_state_dict(), extras={"note": "bench"})
        ours.append({"total_s": round(time.perf_counter() - t0, 4),
                     **{k: round(v, 4) for k, v in ck.last_timings.items()}})
    out["committed_save"] = ours
    t0 = time.perf_counter()
    latest = ck.latest_step()
    out["verify_s"] = round(time.perf_counter() - t0, 4)
    out["latest"] = latest

    reference = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded, step = ck.load(model.sharded_state_dict())
    model.load_state_dict(loaded, strict=False)
    now = model.state_dict()
    out["load_step"] = step
    out["load_bitwise"] = all(torch.equal(reference[k], now[k]) for k in reference if torch.is_tensor(now.get(k)))

    shard = next((work / "ckpt" / "step-2").glob("__0_*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(raw)
    out["after_corruption_latest"] = ck.latest_step()
    ck.close()

    if fixture is not None:
        fixture.mkdir(parents=True, exist_ok=True)
        tiny_args = ModelArgs(arch="gpt", vocab=64, seq_len=16, hidden=32, layers=2, heads=2)
        tiny = build_model(tiny_args, groups, torch.device("cuda", 0), 1).gpt
        tdir = work / "tiny"
        tck = MegatronCheckpointer(MegatronCheckpointConfig(directory=tdir, console=False))
        tck.save(1, tiny.sharded_state_dict(), extras={"model": "tiny gpt, seed 1"})
        with torch.no_grad():
            for p in tiny.parameters():
                p.add_(1.0)  # step 2 differs from step 1
        tck.save(2, tiny.sharded_state_dict(), extras={"model": "tiny gpt, seed 1, +1"})
        tck.close()
        sums = {k: float(v.double().sum()) for k, v in tiny.state_dict().items() if torch.is_tensor(v)
                and v.is_floating_point()}
        (tdir / "expected_sums.json").write_text(json.dumps(sums, sort_keys=True))
        with tarfile.open(fixture / "megatron_ckpt_fixture.tar.gz", "w:gz") as tar:
            tar.add(tdir, arcname="megatron_ckpt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--fixture", default=None, help="write the tiny checkpoint fixture here")
    p.add_argument("--arch", choices=["gpt", "mlp"], default="gpt", help="mlp: a dry run of part 1 on CPU")
    p.add_argument("--skip-checkpoints", action="store_true")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--skip-steps", action="store_true")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="megatron-bench-"))
    result: dict = {"model": {k: getattr(a, k) for k in ("hidden", "layers", "heads", "seq_len", "vocab", "batch")}}
    try:
        if not a.skip_steps:
            print("step time, supervisor vs plain loop:", flush=True)
            result["steps"] = step_ratio(a, work)
            print(f"  ratio (best of {a.reps}): {result['steps']['ratio_best']}", flush=True)
        if not a.skip_checkpoints:
            print("checkpoints:", flush=True)
            result["checkpoints"] = checkpoints(a, work, Path(a.fixture) if a.fixture else None)
            print(json.dumps(result["checkpoints"], indent=1), flush=True)
    finally:
        Path(a.out).write_text(json.dumps(result, indent=1))
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
