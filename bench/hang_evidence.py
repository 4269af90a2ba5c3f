"""Hang detection by evidence, with the default settings: how fast a real hang is found, and that a long step is not
one (CPU, 2 ranks of the GPT example: d_model 32, 2 layers, 2 heads, seq 16, batch 4; gloo).

Each case is a real job under ``resilient-train run`` with no monitor config:

* ``stopped``: rank 1 SIGSTOPs itself before the forward of step 40 (chaos ``hang``);
* ``deadlock``: rank 1's main thread waits, after step 40's reduction, on an event no thread sets (chaos
  ``deadlock``): its peer goes on to step 41's all-reduce and waits there;
* ``eval-every-rank`` / ``eval-rank-0``: an 8 s evaluation at steps 100 and 200 (tests/runtime/eval_script.py),
  on every rank, or on rank 0 while rank 1 waits for it in the step's all-reduce.

For a fault, "detected" is the agent's ``hang_detected`` of rank 1 after the ``fault_injected`` event (seconds
between them), "recovered" the first ``recovery_done`` after it, and "evidence" what the detector saw. For an
evaluation, the ranks killed (none is right) and the job's wall time against the same job without evaluations.

Run: ``python bench/hang_evidence.py [--cases stopped,deadlock,eval-every-rank,eval-rank-0]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT = REPO / "examples" / "train_gpt.py"
EVAL = REPO / "tests" / "runtime" / "eval_script.py"
ARGS = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4", "--log-every", "0",
        "--reproducible"]
FAULTS = {"stopped": {"kind": "hang", "rank": 1, "step": 40, "phase": "forward"},
          "deadlock": {"kind": "deadlock", "rank": 1, "step": 40, "phase": "optimizer"}}


def _run(run_dir: Path, script: Path, steps: int, *, chaos: dict | None = None, env: dict | None = None) -> tuple[
        int, float, list[dict]]:
    cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "2", "--run-dir", str(run_dir)]
    if chaos is not None:
        cmd += ["--chaos", json.dumps([chaos])]
    cmd += [str(script), "--steps", str(steps), *ARGS]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=900)
    wall = time.monotonic() - t0
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-2000:])
    return p.returncode, wall, events


def fault_case(work: Path, name: str) -> str:
    rc, _, ev = _run(work / name, GPT, 80, chaos=FAULTS[name])
    injected = next(e["time"] for e in ev if e["event"] == "fault_injected")
    hang = next(e for e in ev if e["event"] == "hang_detected" and e["rank"] == 1 and e["time"] >= injected)
    done = next(e["time"] for e in ev if e["event"] == "recovery_done" and e["time"] >= injected)
    return (f"| {name} | {rc} | {hang['evidence']} (timeout {hang['timeout_s']:g} s) | {hang['time'] - injected:.1f} s "
            f"| {done - injected:.1f} s |")


def eval_case(work: Path, name: str, baseline_s: float) -> str:
    env = {"EVAL_EVERY": "100", "EVAL_S": "8"} | ({"EVAL_RANK": "0"} if name == "eval-rank-0" else {})
    rc, wall, ev = _run(work / name, EVAL, 220, env=env)
    killed = sorted({e["rank"] for e in ev if e["event"] == "hang_detected"})
    return f"| {name} | {rc} | killed: {killed or 'none'} | {wall:.1f} s | {wall - baseline_s:+.1f} s vs no evaluation |"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="stopped,deadlock,eval-every-rank,eval-rank-0")
    args = p.parse_args()
    cases = args.cases.split(",")
    rows = ["| case | exit | evidence | detected after the fault | recovered after the fault |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        baseline = None
        for name in cases:
            if name in FAULTS:
                rows.append(fault_case(work, name))
            else:
                if baseline is None:
                    _, baseline, _ = _run(work / "no-eval", GPT, 220)
                rows.append(eval_case(work, name, baseline))
            print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
