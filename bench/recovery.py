"""Recovery from a SIGKILLed rank: resilient-train against torchrun, side by side.

The same GPT job and the same fault (rank ``--kill-rank`` SIGKILLed at step
``--kill-step``), run ``--repeats`` times each, interleaved:

* resilient-train: ``resilient-train run`` with a warm spare; the survivors
  stay up at their step boundary and the replacement heals from a live
  replica. ``--script gpt`` is examples/train_gpt.py (the supervisor's own
  reduction), ``--script ddp`` examples/train_ddp.py (a user's DDP loop).
* torchrun: ``torchrun --max-restarts 3`` restarts every worker of a plain DDP
  script, which resume from a torch.distributed.checkpoint saved every
  ``--ckpt-every`` steps.

Reports the seconds from the fault to the next completed step and the steps
redone, for both, and their ratio.

    python bench/recovery.py --nproc 2 --steps 40 --kill-step 25 --repeats 3 [--script ddp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = ["--d-model", "128", "--layers", "2", "--batch", "8", "--seq-len", "32"]


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _next_step_after(events: list[dict], t: float, step: int) -> dict:
    """The first completion of the step the fault interrupted (or a later one).

    A peer may still be finishing the step before it when the fault lands: that
    completion does not count.
    """
    return next(e for e in events if e["event"] == "step_done" and e["time"] > t and e["step"] > step)


def run_ours(work: Path, args: argparse.Namespace) -> tuple[float, int]:
    run_dir = work / "ours"
    fault = [{"kind": "kill", "rank": args.kill_rank, "step": args.kill_step, "phase": "forward"}]
    script = REPO / "examples" / ("train_gpt.py" if args.script == "gpt" else "train_ddp.py")
    model = MODEL + (["--heads", "4", "--dataset", "1024"] if args.script == "ddp" else [])
    cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", str(args.nproc),
           "--run-dir", str(run_dir), "--chaos", json.dumps(fault), str(script),
           "--steps", str(args.steps), "--log-every", "0", *model]
    subprocess.run(cmd, check=True, capture_output=True, timeout=args.attempt_timeout, cwd=REPO)
    events = _events(run_dir / "events.jsonl")
    fault_t = next(e["time"] for e in events if e["event"] == "fault_injected")
    nxt = _next_step_after(events, fault_t, args.kill_step)
    redone = max(e["steps_redone"] for e in events if e["event"] == "recovery_done")
    return nxt["time"] - fault_t, redone


def run_torchrun(work: Path, args: argparse.Namespace) -> tuple[float, int]:
    ckpt, log = work / "torchrun-ckpt", work / "torchrun.jsonl"
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           "--max-restarts", "3", str(REPO / "bench" / "torchrun_baseline.py"), "--steps", str(args.steps),
           "--ckpt-every", str(args.ckpt_every), "--ckpt-dir", str(ckpt), "--events", str(log),
           "--kill-rank", str(args.kill_rank), "--kill-step", str(args.kill_step), *MODEL]
    subprocess.run(cmd, check=True, capture_output=True, timeout=args.attempt_timeout, cwd=REPO, env=env)
    events = _events(log)
    fault_t = next(e["time"] for e in events if e["event"] == "fault_injected")
    resumed = next(e for e in events if e["event"] == "resumed" and e["attempt"] > 0)
    # The next completed step is the first one past the fault's step: the
    # steps torchrun redoes from its checkpoint come first.
    nxt = _next_step_after(events, fault_t, args.kill_step)
    return nxt["time"] - fault_t, args.kill_step - resumed["step"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-step", type=int, default=25)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--script", choices=["gpt", "ddp"], default="gpt", help="our side: the GPT example or the DDP one")
    p.add_argument("--attempt-timeout", type=float, default=180.0,
                   help="a run still going after this many seconds counts as hung (and is killed)")
    args = p.parse_args()
    if not 0 < args.kill_step < args.steps:
        p.error("--kill-step must be inside the run")
    ours, theirs = [], []
    hung = {"resilient-train": 0, "torchrun": 0}
    for i in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="rt-bench-recovery-"))
        line = [f"  repeat {i + 1}:"]
        try:
            for name, run, into in (("resilient-train", run_ours, ours), ("torchrun", run_torchrun, theirs)):
                try:
                    into.append(run(work, args))
                    line.append(f"{name} {into[-1][0]:.2f} s ({into[-1][1]} redone)")
                except subprocess.TimeoutExpired:
                    hung[name] += 1
                    line.append(f"{name} HUNG (killed after {args.attempt_timeout:g} s)")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(" ".join(line), flush=True)
    if not ours or not theirs:
        print(f"no completed run to compare: hung {hung}")
        return 1
    o = statistics.median(t for t, _ in ours)
    t = statistics.median(t for t, _ in theirs)
    print(f"\n{args.nproc} ranks, SIGKILL of rank {args.kill_rank} at step {args.kill_step}, "
          f"median of {args.repeats}:")
    print("| runtime | fault to next completed step (s) | steps redone |")
    print("| --- | --- | --- |")
    print(f"| resilient-train, {args.script} (warm spare, heal from a live replica) | {o:.2f} | "
          f"{max(r for _, r in ours)} |")
    print(f"| torchrun --max-restarts 3 + DCP every {args.ckpt_every} | {t:.2f} | {max(r for _, r in theirs)} |")
    print(f"| ratio (torchrun / resilient-train) | {t / o:.1f}x | |")
    print(f"hung runs (killed after {args.attempt_timeout:g} s): resilient-train {hung['resilient-train']}, "
          f"torchrun {hung['torchrun']} of {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
