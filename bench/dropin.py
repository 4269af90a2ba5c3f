"""Unmodified torchrun scripts, SIGKILLed mid-run: ``resilient-train run`` against ``torchrun``.

Two scripts nobody wrote for this runtime (tests/runtime/dropin/): a plain
all-reduce loop, and a nanoGPT-shaped DDP trainer that resumes from its own
checkpoint file. Each is started with the same flags under both launchers
(``--standalone --nproc-per-node N --max-restarts 3``); once rank 0 has done
``--kill-at`` iterations, rank 1 is SIGKILLed from outside. Measured, per run:
seconds from the kill to the next iteration rank 0 starts, and whether the
restarted attempt hung or failed (no iteration within ``--hang-after``
seconds, or the launcher gave up without one). Runs alternate between the
launchers.

    python bench/dropin.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "runtime" / "dropin"


def _launcher(name: str, run_dir: Path) -> list[str]:
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run"]
    return [sys.executable, "-m", "resilient_train.cli", "run", "--run-dir", str(run_dir)]


def _steps(log: Path) -> list[tuple[float, int, int]]:
    if not log.exists():
        return []
    rows = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return rows


def _rank_pid(marker: str, rank: int) -> int | None:
    """The worker with RANK=rank among the processes carrying this run's marker in their environment."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"BENCH_MARKER={marker}".encode() in env and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def one_run(launcher: str, script: str, args: argparse.Namespace, work: Path, n: int) -> tuple[float | None, bool]:
    """(seconds from the kill to the next iteration, hung or failed?)."""
    tag = f"{launcher}-{script}-{n}"
    out, log = work / tag, work / f"{tag}.steps"
    out.mkdir()
    marker = f"{os.getpid()}-{tag}"
    env = {**os.environ, "STEP_LOG": str(log), "BENCH_MARKER": marker, "MAX_ITERS": str(args.iters),
           "OMP_NUM_THREADS": "1"}
    if script == "loop":
        target, script_args = SCRIPTS / "allreduce_loop.py", [str(out), str(args.loop_seconds)]
    else:
        target, script_args = SCRIPTS / "nanogpt_like.py", [str(out)]
    cmd = [*_launcher(launcher, work / f"{tag}.run"), "--standalone", "--nproc-per-node", str(args.nproc),
           "--max-restarts", "3", str(target), *script_args]
    errlog = open(work / f"{tag}.stderr", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=errlog,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + args.timeout
        while not any(it >= args.kill_at for _, it, a in _steps(log) if a == 0):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{tag}: never reached iteration {args.kill_at}")
            time.sleep(0.01)
        pid = _rank_pid(marker, 1)
        if pid is None:
            raise RuntimeError(f"{tag}: rank 1 not found")
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        hang_deadline = time.monotonic() + args.hang_after
        while True:
            after = [t for t, _, a in _steps(log) if a > 0 and t > killed]
            if after:
                recovered: float | None = min(after) - killed
                hung = False
                break
            if time.monotonic() > hang_deadline:
                recovered, hung = None, True
                break
            if proc.poll() is not None:  # every restart failed (torchrun's shared store: stale keys)
                print(f"  {tag}: the launcher exited ({proc.returncode}) without a new iteration",
                      file=sys.stderr, flush=True)
                recovered, hung = None, True
                break
            time.sleep(0.01)
        if not hung:
            proc.wait(timeout=args.timeout)
            if proc.returncode != 0:
                print(f"  {tag}: the launcher exited {proc.returncode} after the restart", file=sys.stderr, flush=True)
        return recovered, hung
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=15, help="iteration of rank 0 after which rank 1 is killed")
    p.add_argument("--iters", type=int, default=40, help="nanoGPT-shaped script's iterations")
    p.add_argument("--loop-seconds", type=float, default=6.0, help="the all-reduce loop's length")
    p.add_argument("--hang-after", type=float, default=60.0, help="seconds without an iteration that count as hung")
    p.add_argument("--timeout", type=float, default=180.0)
    args = p.parse_args()
    results: dict[tuple[str, str], list[tuple[float | None, bool]]] = {}
    with tempfile.TemporaryDirectory(prefix="rt-dropin-") as tmp:
        work = Path(tmp)
        for n in range(args.repeats):
            for script in ("loop", "nanogpt"):
                for launcher in ("resilient-train", "torchrun"):
                    r = one_run(launcher, script, args, work, n)
                    results.setdefault((script, launcher), []).append(r)
                    print(f"  {script:8} {launcher:16} run {n}: "
                          + ("hung" if r[1] else f"{r[0]:.2f} s"), file=sys.stderr, flush=True)
    print("| script | launcher | kill → next iteration, s (median; runs) | runs that hung or failed |")
    print("|---|---|---|---|")
    for script in ("loop", "nanogpt"):
        medians = {}
        for launcher in ("resilient-train", "torchrun"):
            rows = results[(script, launcher)]
            ok = [t for t, hung in rows if not hung and t is not None]
            medians[launcher] = statistics.median(ok) if ok else float("nan")
            runs = ", ".join("hung" if hung else f"{t:.2f}" for t, hung in rows)
            print(f"| {script} | {launcher} | {medians[launcher]:.2f} ({runs}) | "
                  f"{sum(h for _, h in rows)} of {len(rows)} |")
        print(f"| {script} | ratio | {medians['resilient-train'] / medians['torchrun']:.2f}× | |")


if __name__ == "__main__":
    main()
