"""What the dashboard costs: server CPU while a 4-rank job runs with a page open, and the
snapshot cost at 1,024 ranks.

    python bench/dashboard_cost.py [--seconds 60] [--interval 1.0]

1. Starts the example GPT job on 4 CPU ranks under ``resilient-train run`` (straggler reports
   every ``--interval`` seconds), then ``resilient-train dashboard RUN_DIR`` as its own process,
   and opens the page in headless Chromium (the page stays connected to the live stream).
2. Samples the dashboard process's CPU time (utime + stime from /proc) over ``--seconds``.
3. Builds a synthetic log of 1,024 ranks x 720 reports (an hour at the default 5 s interval)
   and times the first read and one snapshot (what each push costs the server).

Needs the test extra (playwright) and a Chromium binary (Debian: apt-get install chromium).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "monitors"))

from jobs import GPT, SMALL_GPT  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime, stime


def live_cost(seconds: float, interval: float) -> None:
    from browser import chromium

    tmp = Path(tempfile.mkdtemp(prefix="rt-dash-bench-"))
    run = tmp / "run"
    cfg = tmp / "monitor.json"
    cfg.write_text(json.dumps({"straggler": {"report_interval_s": interval},
                               "metrics": {"prometheus": False, "tensorboard": False}}))
    env = dict(os.environ)
    job = subprocess.Popen([sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "4",
                            "--run-dir", str(run), "--monitor-config", str(cfg), str(GPT), "--steps", "1000000",
                            *SMALL_GPT], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dash = None
    try:
        run.mkdir(parents=True, exist_ok=True)
        dash = subprocess.Popen([sys.executable, "-m", "resilient_train.cli", "dashboard", str(run), "--port", "0"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        assert dash.stdout is not None
        url = re.search(r"dashboard: (http://\S+)", dash.stdout.readline()).group(1)  # type: ignore[union-attr]
        with chromium() as page:
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']", timeout=120_000)
            page.wait_for_function("Number(document.body.dataset.version) > 0 && "
                                   "document.querySelector('#run-state').dataset.state === 'running'", timeout=120_000)
            page.wait_for_selector("#heatmap[data-worst]:not([data-worst=''])", timeout=120_000)  # ranks train
            c0, t0 = cpu_s(dash.pid), time.monotonic()
            v0 = int(page.get_attribute("body", "data-version") or 0)
            time.sleep(seconds)  # a measurement window, not a wait for an event
            c1, t1 = cpu_s(dash.pid), time.monotonic()
            v1 = int(page.get_attribute("body", "data-version") or 0)
        events = sum(1 for _ in open(run / "events.jsonl"))
        print(f"live: 4-rank job, reports every {interval:g} s, one page open: dashboard process used "
              f"{c1 - c0:.2f} s CPU in {t1 - t0:.1f} s = {100 * (c1 - c0) / (t1 - t0):.1f}% of one core; "
              f"{v1 - v0} model versions pushed; {events} events in the log at the end")
    finally:
        for p in (dash, job):
            if p is not None:
                p.kill()
                p.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


def scale_cost(ranks: int = 1024, reports: int = 720) -> None:
    from monitors.dashboard.model import RunModel

    tmp = Path(tempfile.mkdtemp(prefix="rt-dash-bench-"))
    try:
        t0 = 1.8e9
        with open(tmp / "events.jsonl", "w") as f:
            f.write(json.dumps({"time": t0, "event": "agent_start", "source": "agent", "world_size": ranks}) + "\n")
            for i in range(1, reports + 1):
                scores = {str(r): {"relative": 0.9 + (r % 10) / 100, "individual": 0.95, "step_s": 0.1, "work_s": 0.08,
                                   "steps": 50, "last_step": 50 * i, "clock": "cuda",
                                   "sections_s": {"data": 0.001, "forward": 0.03, "backward": 0.05, "all-reduce": 0.01,
                                                  "optimizer": 0.005}} for r in range(ranks)}
                f.write(json.dumps({"time": t0 + 5 * i, "event": "straggler_report", "source": "monitor", "interval": i,
                                    "enabled": True, "threshold": 0.75, "control_read_at": t0 + 5 * i,
                                    "scores": scores}) + "\n")
        size = (tmp / "events.jsonl").stat().st_size
        model = RunModel(tmp)
        a = time.perf_counter()
        model.refresh()
        b = time.perf_counter()
        snap = model.snapshot()
        c = time.perf_counter()
        text = json.dumps(snap)
        d = time.perf_counter()
        print(f"scale: {ranks} ranks x {reports} reports ({size / 1e6:.0f} MB of events): first read {b - a:.1f} s, "
              f"one snapshot {1000 * (c - b):.0f} ms + {1000 * (d - c):.0f} ms to serialise, {len(text) / 1e3:.0f} kB "
              f"pushed per update")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--skip-live", action="store_true")
    args = p.parse_args()
    if not args.skip_live:
        live_cost(args.seconds, args.interval)
    scale_cost()


if __name__ == "__main__":
    main()
