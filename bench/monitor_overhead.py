"""What do the monitors cost, and how fast do they catch a hang? (CPU)

1. Overhead: the GPT example's training step (examples/train_gpt.py's model and
   data, one process) with every monitor on and with them off, interleaved in
   blocks in one run. "On" means the rank writes its progress slot at each of
   the 6 phases of every step, and a separate monitor process (a NodeMonitor:
   hang detection, straggler scoring, the Prometheus endpoint) polls it every
   50 ms, as the node agent does. "Off" means neither. Also the raw cost of one
   ``ProgressReporter.enter`` and of one ``NodeMonitor.poll``.
2. Hang latency: a real 4-rank GPT job under ``resilient-train run`` with the
   default (computed) timeouts; one rank is SIGSTOPped at step 8. We report the
   timeout the detector applied, the time from the rank's last progress to the
   detection, from the injection to the agent's kill, and the recovery.
3. NVRx's ``ft_launcher`` on the same hang, side by side: bench/hang_latency.py
   (needs ``pip install nvidia-resiliency-ext==0.4.1``, the ``nvrx`` extra).

4. GPU (``--device cuda``): the same step on one GPU, bigger, each step ending
   with a synchronisation so its time is the GPU's. Modes interleaved in
   blocks: off; ours (the progress slot with CUDA events at each phase change,
   the NodeMonitor polling from another process); and, when
   nvidia-resiliency-ext is importable, NVRx's straggler ``Detector`` with its
   CUPTI kernel profiling on every section (``profile_cuda=True``,
   ``profiling_interval=1``) and ``generate_report_if_interval_elapsed`` after
   every step on a one-rank process group.

Run: ``python bench/monitor_overhead.py [--blocks 20] [--steps-per-block 10] [--hang-runs 2]``;
on a GPU: ``python bench/monitor_overhead.py --device cuda --hang-runs 0``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from monitors.cupti_kernels import nvrx_installed  # noqa: E402  (after the path)

PHASES = ("data", "forward", "backward", "all-reduce", "optimizer", "between-steps")


def _monitor_process(run_dir: str, active: "mp.synchronize.Event", stop: "mp.synchronize.Event") -> None:
    from monitors import MetricsConfig, MonitorConfig, NodeMonitor, StragglerConfig

    cfg = MonitorConfig(straggler=StragglerConfig(report_interval_s=1.0), metrics=MetricsConfig(tensorboard=False))
    mon = NodeMonitor(cfg, run_dir, [0])
    while not stop.is_set():
        if active.wait(timeout=0.1):
            mon.poll()
            stop.wait(0.05)
    mon.close()


def overhead(blocks: int, steps_per_block: int) -> dict[str, float]:
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    from train_gpt import GPT, GPTConfig, batch

    from monitors import NodeMonitor, MonitorConfig, MetricsConfig, ProgressReporter

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=128, layers=2, heads=4, seq_len=64)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_dir = tempfile.mkdtemp(prefix="monitor-bench-")
    rep = ProgressReporter(run_dir, 0)
    ctx = mp.get_context("spawn")
    active, stop = ctx.Event(), ctx.Event()
    mon = ctx.Process(target=_monitor_process, args=(run_dir, active, stop), daemon=True)
    mon.start()

    def step(i: int, on: bool) -> float:
        t0 = time.perf_counter()
        if on:
            rep.enter("data", i)
        x, y = batch(0, i, 0, size=8, cfg=cfg, device=torch.device("cpu"))
        if on:
            rep.enter("forward", i)
        loss = model(x, y)
        if on:
            rep.enter("backward", i)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if on:
            rep.enter("all-reduce", i)
            rep.enter("optimizer", i)
        opt.step()
        if on:
            rep.enter("between-steps", i)
        return time.perf_counter() - t0

    for i in range(5):  # warm-up
        step(i, True)
    # Blocks cycle off, on, off again: "off again" is "off" under another name, the noise floor (A/A).
    modes = ("off", "on", "off-again")
    times: dict[str, list[float]] = {m: [] for m in modes}
    i = 5
    for b in range(blocks * 3 // 2):
        mode = modes[b % 3]
        (active.set if mode == "on" else active.clear)()
        for _ in range(steps_per_block):
            times[mode].append(step(i, mode == "on"))
            i += 1
    stop.set()
    mon.join(timeout=10)

    n = 100_000
    t0 = time.perf_counter()
    for k in range(n):
        rep.enter(PHASES[k % 6], k // 6)
    enter_us = (time.perf_counter() - t0) / n * 1e6
    probe = NodeMonitor(MonitorConfig(metrics=MetricsConfig(prometheus=False, tensorboard=False)), run_dir, [0])
    t0 = time.perf_counter()
    for _ in range(1000):
        probe.hangs.poll()
    poll_us = (time.perf_counter() - t0) / 1000 * 1e6
    probe.close()
    rep.close()
    on_s, off_s = statistics.median(times["on"]), statistics.median(times["off"])
    again_s = statistics.median(times["off-again"])
    return {"step_on_s": on_s, "step_off_s": off_s, "overhead_pct": 100 * (on_s / off_s - 1),
            "aa_pct": 100 * (again_s / off_s - 1),
            "steps_each": len(times["on"]), "enter_us": enter_us, "hang_poll_us_per_rank": poll_us}


def overhead_gpu(blocks: int, steps_per_block: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "examples"))
    from train_gpt import GPT, GPTConfig, batch

    from monitors import ProgressReporter

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=512, layers=4, heads=8, seq_len=256)
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run_dir = tempfile.mkdtemp(prefix="monitor-bench-gpu-")
    rep = ProgressReporter(run_dir, 0, cuda_device=dev)
    ctx = mp.get_context("spawn")
    active, stop = ctx.Event(), ctx.Event()
    mon = ctx.Process(target=_monitor_process, args=(run_dir, active, stop), daemon=True)
    mon.start()

    modes = ["off", "ours", "off-again"]  # "off-again" is "off" under another name: the noise floor (A/A)
    detector = None
    if nvrx_installed():
        from nvidia_resiliency_ext import straggler

        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
        straggler.Detector.initialize(scores_to_compute="all", gather_on_rank0=True, profiling_interval=1,
                                      report_time_interval=1.0)
        detector = straggler.Detector
        modes.append("nvrx")

    def step(i: int, mode: str) -> float:
        sections = iter(PHASES)
        open_cm = None

        def enter() -> None:
            nonlocal open_cm
            name = next(sections)
            if mode == "ours":
                rep.enter(name, i)
            elif mode == "nvrx":
                if open_cm is not None:
                    open_cm.__exit__(None, None, None)
                open_cm = detector.detection_section(name, profile_cuda=True) if name != "between-steps" else None
                if open_cm is not None:
                    open_cm.__enter__()

        t0 = time.perf_counter()
        enter()  # data
        x, y = batch(0, i, 0, size=16, cfg=cfg, device=dev)
        enter()  # forward
        loss = model(x, y)
        enter()  # backward
        opt.zero_grad(set_to_none=True)
        loss.backward()
        enter()  # all-reduce (none: one GPU)
        enter()  # optimizer
        opt.step()
        enter()  # between-steps
        if mode == "nvrx":
            detector.generate_report_if_interval_elapsed()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for i in range(10):  # warm-up, every mode
        step(i, modes[i % len(modes)])
    times: dict[str, list[float]] = {m: [] for m in modes}
    i = 10
    for b in range(blocks * len(modes) // 2):
        mode = modes[b % len(modes)]
        (active.set if mode == "ours" else active.clear)()
        for _ in range(steps_per_block):
            times[mode].append(step(i, mode))
            i += 1
    stop.set()
    mon.join(timeout=10)
    n = 60_000
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(n):
        rep.enter(PHASES[k % 6], i + k // 6)
    enter_us = (time.perf_counter() - t0) / n * 1e6
    plain = ProgressReporter(run_dir, 1)
    t0 = time.perf_counter()
    for k in range(n):
        plain.enter(PHASES[k % 6], k // 6)
    plain_us = (time.perf_counter() - t0) / n * 1e6
    plain.close()
    rep.close()
    if detector is not None:
        detector.shutdown()
        dist.destroy_process_group()
    off = statistics.median(times["off"])
    out: dict[str, dict[str, float]] = {
        m: {"step_s": statistics.median(t), "overhead_pct": 100 * (statistics.median(t) / off - 1), "steps": len(t)}
        for m, t in times.items()
    }
    out["enter"] = {"cuda_us": enter_us, "wall_only_us": plain_us}
    return out


def hang_latency(runs: int) -> list[dict[str, float]]:
    out = []
    for r in range(runs):
        run_dir = Path(tempfile.mkdtemp(prefix="monitor-hang-")) / "run"
        faults = [{"kind": "hang", "rank": 2, "step": 8, "phase": "forward"}]
        cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
               "--chaos", json.dumps(faults), str(REPO / "examples" / "train_gpt.py"), "--steps", "16",
               "--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4", "--log-every", "0"]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise SystemExit(f"hang run failed:\n{p.stderr[-2000:]}")
        ev = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
        injected = next(e for e in ev if e["event"] == "fault_injected")
        hang = next(e for e in ev if e["event"] == "hang_detected" and e["rank"] == 2)
        killed = next(e for e in ev if e["event"] == "fault_detected" and e["source"] == "agent")
        done = [e for e in ev if e["event"] == "recovery_done"]
        out.append({
            "timeout_s": hang["timeout_s"], "since_progress_s": hang["since_progress_s"],
            "inject_to_kill_s": killed["time"] - injected["time"],
            "inject_to_recovered_s": max(e["time"] for e in done) - injected["time"],
        })
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--steps-per-block", type=int, default=10)
    p.add_argument("--hang-runs", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    if args.device == "cuda":
        g = overhead_gpu(args.blocks, args.steps_per_block)
        enter = g.pop("enter")
        off = g["off"]["step_s"]
        print(f"GPU overhead: GPT step (d_model 512, 4 layers, batch 16x256, AdamW), synchronised, "
              f"median of {g['off']['steps']} steps per mode, interleaved")
        for mode, r in g.items():
            label = {"off": "monitors off", "off-again": "monitors off again (A/A: the noise floor)",
                     "ours": "ours: progress slot + CUDA events + NodeMonitor",
                     "nvrx": "NVRx straggler Detector, CUPTI on every section"}[mode]
            print(f"  {label:<52} {r['step_s'] * 1e3:8.3f} ms  {r['overhead_pct']:+6.2f}%  "
                  f"({r['step_s'] / off:.4f}x off)")
        print(f"  ProgressReporter.enter on this host: {enter['cuda_us']:.2f} us with CUDA events, "
              f"{enter['wall_only_us']:.2f} us wall clock only; 6 per step = "
              f"{100 * 6 * enter['cuda_us'] * 1e-6 / off:.3f}% of the step")
        if "nvrx" not in g:
            print("  NVRx: nvidia-resiliency-ext is not importable; its CUPTI detector was not measured")
    o = overhead(args.blocks, args.steps_per_block)
    print(f"overhead: GPT step (d_model 128, 2 layers, batch 8x64, 1 thread) median "
          f"{o['step_off_s'] * 1e3:.2f} ms off, {o['step_on_s'] * 1e3:.2f} ms on "
          f"({o['steps_each']} steps each, interleaved): {o['overhead_pct']:+.2f}%; "
          f"off again (A/A, the noise floor): {o['aa_pct']:+.2f}%")
    print(f"  ProgressReporter.enter: {o['enter_us']:.2f} us; HangDetector.poll: {o['hang_poll_us_per_rank']:.1f} us/rank")
    print(f"  in-rank cost per step: 6 x enter = {6 * o['enter_us']:.1f} us = "
          f"{100 * 6 * o['enter_us'] * 1e-6 / o['step_off_s']:.3f}% of the step")
    for i, h in enumerate(hang_latency(args.hang_runs)):
        print(f"hang run {i}: computed timeout {h['timeout_s']:.2f} s; detected {h['since_progress_s']:.2f} s after "
              f"the last progress; injection -> kill {h['inject_to_kill_s']:.2f} s; "
              f"injection -> every rank recovered {h['inject_to_recovered_s']:.2f} s")
    if not nvrx_installed():
        print("NVRx ft_launcher: nvidia-resiliency-ext is not installed; comparison skipped")
    else:
        print("NVRx ft_launcher on the same hang: python bench/hang_latency.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
