"""``resilient-train demo``: watch a job survive a killed rank and a failing one.

Runs the GPT example twice on CPU ranks under the agent: once fault-free, once
with one rank SIGKILLed mid-step and another raising later. Shows live
progress, then reports the faults, the recovery times, and whether the two
final states are equal bit for bit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from monitors import max_local_ranks, read_events
from resilient_train.base.safefiles import writable_dir

__all__ = ["run_demo", "summarize_recoveries"]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
# Small enough for a laptop's cores, large enough to be a real transformer.
MODEL_ARGS = ["--d-model", "128", "--layers", "2", "--heads", "4", "--seq-len", "32", "--batch", "8", "--log-every", "0",
              "--reproducible"]


def _faults(steps: int, nproc: int) -> list[dict[str, Any]]:
    return [
        {"kind": "kill", "rank": 1 % nproc, "step": steps // 3, "phase": "backward"},
        {"kind": "raise", "rank": (nproc - 1), "step": (2 * steps) // 3, "phase": "forward"},
    ]


def _launch(run_dir: Path, steps: int, nproc: int, faults: list[dict[str, Any]] | None) -> subprocess.Popen:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir)]
    if faults:
        cmd += ["--chaos", json.dumps(faults)]
    cmd += [str(EXAMPLE), "--steps", str(steps), *MODEL_ARGS]
    log = open(run_dir / "job.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _watch(label: str, proc: subprocess.Popen, run_dir: Path, steps: int, timeout: float) -> int:
    """Prints progress from the run's events until the job ends."""
    tty = sys.stdout.isatty()
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        rc = proc.poll()
        events = list(read_events(run_dir / "events.jsonl"))
        step = max((e["step"] for e in events if e["event"] == "step_done"), default=0)
        faults = sum(e["event"] == "fault_injected" for e in events)
        recovered = len({e["generation"] for e in events if e["event"] == "recovery_done"})
        loss = next((e.get("loss") for e in reversed(events) if e["event"] == "step_done"), None)
        bar = "#" * (20 * step // max(steps, 1))
        line = f"  {label:<10} [{bar:<20}] step {step:>4}/{steps}  faults {faults}  recoveries {recovered}"
        if loss is not None:
            line += f"  loss {loss:.3f}"
        if line != last:
            print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
            last = line
        if rc is not None:
            if tty:
                print()
            return rc
        if time.monotonic() > deadline:
            proc.kill()
            print(f"\n  {label}: no end after {timeout:.0f} s, stopped", flush=True)
            return 124
        time.sleep(0.5 if not tty else 0.2)


def summarize_recoveries(run_dir: Path) -> list[str]:
    events = list(read_events(run_dir / "events.jsonl"))
    lines = []
    injected = [e for e in events if e["event"] == "fault_injected"]
    steps_done = [e for e in events if e["event"] == "step_done"]
    for f in injected:
        # The interrupted step's own completion (a peer may finish the step before it after the fault).
        next_step = next((s for s in steps_done if s["time"] > f["time"] and s["step"] > f["step"]), None)
        done = [e for e in events if e["event"] == "recovery_done" and e["time"] > f["time"]]
        gen = done[0]["generation"] if done else None
        ranks = [e for e in done if e["generation"] == gen]
        redone = max((e["steps_redone"] for e in ranks), default=0)
        back = f"{next_step['time'] - f['time']:.2f} s to the next step" if next_step else "no step after it"
        parts = (
            f"rendezvous {max(e['rendezvous_s'] for e in ranks):.2f} s, heal {max(e['heal_s'] for e in ranks):.3f} s"
            if ranks else "no recovery recorded"
        )
        lines.append(
            f"  {f['kind']:<5} rank {f['rank']} at step {f['step']} ({f['phase']}): {back}; {parts}; steps redone {redone}"
        )
    return lines


def run_demo(*, steps: int = 60, nproc: int = 4, run_dir: str = "runs/demo", timeout: float = 900) -> int:
    from checkpointing import diff_states

    if steps < 6:
        raise ValueError(f"--steps must be at least 6 for the faults to land mid-run, got {steps}")
    if nproc < 2:
        raise ValueError(f"--nproc-per-node must be at least 2, got {nproc}")
    if nproc > max_local_ranks():
        raise ValueError(f"--nproc-per-node {nproc}: at most {max_local_ranks()} ranks on this node (4 per CPU core)")
    root = writable_dir(run_dir, "--run-dir")
    faults = _faults(steps, nproc)
    print(f"resilient-train demo: a small GPT on {nproc} CPU ranks, {steps} steps, twice.")
    for f in faults:
        print(f"  fault planned: {f['kind']} on rank {f['rank']} at step {f['step']} ({f['phase']})")
    runs = {}
    for label, planned in (("fault-free", None), ("faulted", faults)):
        t0 = time.monotonic()
        proc = _launch(root / label, steps, nproc, planned)
        rc = _watch(label, proc, root / label, steps, timeout)
        runs[label] = (rc, time.monotonic() - t0)
        if rc != 0:
            print(f"resilient-train demo: the {label} run failed (exit {rc}); see {root / label / 'job.log'}")
            return 1
    print("\nFaults and recoveries:")
    for line in summarize_recoveries(root / "faulted"):
        print(line)
    print(f"\nWall time: fault-free {runs['fault-free'][1]:.1f} s, faulted {runs['faulted'][1]:.1f} s")
    diff = diff_states(root / "fault-free" / "final", root / "faulted" / "final")
    if diff is None:
        print("Final states: bitwise identical (model, optimizer, data position, RNG states of every rank).")
        return 0
    print(f"Final states DIFFER: {diff}")
    return 1
