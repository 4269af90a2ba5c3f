"""Hang-detection latency: resilient-train against NVRx's ``ft_launcher``, on the same hang, in one run (CPU).

The same job (the GPT example: d_model 32, 2 layers, 2 heads, seq 16, batch 4,
16 steps, 4 ranks, gloo) and the same fault (rank 2 SIGSTOPs itself before the
forward of step 8, on the first attempt) under:

* ``resilient-train run`` (examples/train_gpt.py) with the default monitor
  config: progress slots, computed timeouts (5 x the largest observed section
  time, floor 3 s), the agent kills the hung rank and the runtime replaces it
  from a warm spare, the survivors roll back in memory;
* ``ft_launcher`` of nvidia-resiliency-ext (bench/nvrx_train_gpt.py): a
  heartbeat per step, heartbeat timeouts calculated after 5 steps
  (``calculate_and_set_hb_timeouts``: 5 x the largest interval), every other
  setting at ft_launcher's defaults (``workload_check_interval`` 5 s,
  ``--monitor-interval`` 0.1 s, restart policy any-failed); rank 0 checkpoints
  after every step so the restart loses no step.

Runs alternate (NVRx, ours, NVRx, ours, ...). The harness polls the initial
workers' pids every 5 ms: "detected" is the first of them to die (the rank a
monitor killed; under NVRx it can be a healthy rank blocked behind the hung one,
which triggers the same restart of every worker), "resumed" the first training
step completed after the injection (a step needs every rank). Both are seconds
after the ``fault_injected`` event the hung rank writes just before it stops.

Run: ``python bench/hang_latency.py [--runs 3] [--timeout-s 180]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HANG_RANK, HANG_STEP, STEPS, RANKS = 2, 8, 16, 4
MODEL_ARGS = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4"]


def _alive(pid: int) -> bool:
    """False once the process is gone or a zombie (killed, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _read_events(paths: list[Path]) -> list[dict]:
    out = []
    for p in paths:
        if p.exists():
            for line in p.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line being written
                    pass
    return out


def _watch(cmd: list[str], log: Path, events: "callable", initial_pids: "callable", timeout_s: float) -> dict:
    """Runs ``cmd`` in its own session; returns when it exits. Records the first death of an initial worker
    after the injection. Kills the whole session at the end (leftover rank monitors, a stopped rank)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    injected_at: float | None = None
    pids: list[int] = []
    first_death: float | None = None
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"{cmd[:3]}... ran past {timeout_s} s; log: {log}")
            if first_death is None:
                if injected_at is None:
                    ev = events()
                    inj = [e for e in ev if e["event"] == "fault_injected"]
                    if inj:
                        injected_at = inj[0]["time"]
                        pids = initial_pids(ev)
                if pids:
                    now = time.time()
                    if not all(_alive(p) for p in pids):
                        first_death = now
            time.sleep(0.005)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]}... exited {proc.returncode}; log: {log}")
    ev = events()
    inj = next(e for e in ev if e["event"] == "fault_injected")
    resumed = min(e["time"] for e in ev if e["event"] == "step_done" and e["step"] > HANG_STEP)
    if first_death is None:
        raise SystemExit(f"no initial worker was seen dying after the injection; log: {log}")
    return {"detected_s": first_death - inj["time"], "resumed_s": resumed - inj["time"], "events": ev}


def run_ours(work: Path, timeout_s: float) -> dict:
    run_dir = work / "run"
    faults = [{"kind": "hang", "rank": HANG_RANK, "step": HANG_STEP, "phase": "forward"}]
    cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", str(RANKS), "--run-dir", str(run_dir),
           "--chaos", json.dumps(faults), str(REPO / "examples" / "train_gpt.py"), "--steps", str(STEPS),
           *MODEL_ARGS, "--log-every", "0"]

    def events() -> list[dict]:
        return _read_events([run_dir / "events.jsonl"])

    def pids(ev: list[dict]) -> list[int]:
        return [e["pid"] for e in ev if e["event"] == "worker_spawned" and not e["replacement"]]

    r = _watch(cmd, work / "ours.log", events, pids, timeout_s)
    ev = r.pop("events")
    inj = next(e for e in ev if e["event"] == "fault_injected")
    hang = next(e for e in ev if e["event"] == "hang_detected" and e["rank"] == HANG_RANK)
    killed = next(e for e in ev if e["event"] == "fault_detected" and e.get("source") == "agent")
    r.update(timeout_s=hang["timeout_s"], killed_rank=killed["rank"],
             agent_event_s=killed["time"] - inj["time"])
    return r


def run_nvrx(work: Path, timeout_s: float) -> dict:
    out = work / "nvrx"
    out.mkdir()
    cfg = out / "ft.yaml"
    # As NVRx's heartbeat example: no timeouts until the script calculates them.
    cfg.write_text("fault_tolerance:\n  initial_rank_heartbeat_timeout: null\n  rank_heartbeat_timeout: null\n")
    launcher = shutil.which("ft_launcher", path=str(Path(sys.executable).parent)) or "ft_launcher"
    cmd = [launcher, "--standalone", "--nproc-per-node", str(RANKS), "--max-restarts", "2", "--ft-cfg-path", str(cfg),
           str(REPO / "bench" / "nvrx_train_gpt.py"), "--out", str(out), "--steps", str(STEPS), *MODEL_ARGS,
           "--calc-at", "5", "--hang-rank", str(HANG_RANK), "--hang-step", str(HANG_STEP)]

    def events() -> list[dict]:
        return _read_events(sorted(out.glob("events-rank*.jsonl")))

    def pids(ev: list[dict]) -> list[int]:
        return [e["pid"] for e in ev if e["event"] == "worker_start" and e["attempt"] == 0]

    r = _watch(cmd, work / "nvrx.log", events, pids, timeout_s)
    ev = r.pop("events")
    inj = next(e for e in ev if e["event"] == "fault_injected")
    hb = [e["hb"] for e in ev if e["event"] == "timeouts" and e["hb"]["were_calculated"] and e["attempt"] == 0]
    r["timeout_s"] = hb[0]["subsequent"] if hb else float("nan")
    early = [e for e in ev if e["event"] == "worker_start" and e["attempt"] > 0 and e["time"] < inj["time"]]
    if early:
        raise SystemExit(f"NVRx restarted the workers before the injection (a false hang); log: {work / 'nvrx.log'}")
    attempts = {e["attempt"] for e in ev if e["event"] == "worker_start"}
    r["restarts"] = max(attempts)
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="runs of each launcher, alternated (default 3)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="limit per run (default 180)")
    args = p.parse_args()
    try:
        import nvidia_resiliency_ext.fault_tolerance  # noqa: F401
    except ImportError as e:
        print(f"NVRx is not importable ({e}); pip install nvidia-resiliency-ext==0.4.1 (the nvrx extra)")
        return 2
    rows: dict[str, list[dict]] = {"nvrx": [], "ours": []}
    base = Path(tempfile.mkdtemp(prefix="hang-latency-"))
    for i in range(args.runs):
        for name, fn in (("nvrx", run_nvrx), ("ours", run_ours)):
            work = base / f"{name}-{i}"
            work.mkdir()
            r = fn(work, args.timeout_s)
            rows[name].append(r)
            print(f"run {i} {name:4s}: timeout {r['timeout_s']:.2f} s; SIGSTOP -> detected {r['detected_s']:.2f} s; "
                  f"-> resumed {r['resumed_s']:.2f} s", flush=True)
    print()
    print(f"median of {args.runs} runs each (seconds after the SIGSTOP of rank {HANG_RANK} at step {HANG_STEP}):")
    print(f"{'':34s}{'resilient-train':>16s}{'NVRx ft_launcher':>18s}{'NVRx / ours':>13s}")
    for key, label in (("timeout_s", "hang timeout applied"), ("detected_s", "detected (a worker killed)"),
                       ("resumed_s", "training resumed (next step)")):
        o = statistics.median(r[key] for r in rows["ours"])
        n = statistics.median(r[key] for r in rows["nvrx"])
        print(f"{label:34s}{o:16.2f}{n:18.2f}{n / o:12.1f}x")
    print(f"logs and events: {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
