"""Worker processes for the monitor tests: real ranks that report progress.

Sleeps here are the *workload* of a simulated training step, never test
synchronisation; the tests wait on progress slots, events and pipes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from monitors.progress import ProgressReporter

WORK = {"data": 0.001, "forward": 0.010, "backward": 0.020, "optimizer": 0.001}


def train_loop(run_dir: str, rank: int, plan: dict[str, Any], barrier: Any = None, stop: Any = None) -> None:
    """Steps forever (or ``plan["steps"]``) until ``stop`` is set.

    plan keys: ``steps``; ``slow_rank``, ``slow_from``, ``slow_factor`` (a straggler);
    ``hang_at`` (a step) with ``hang`` in "spin", "block-data", "self-stop";
    ``ticks`` (a shared counter a heartbeat thread bumps while the main thread hangs);
    ``eval_at`` (a step) with ``eval_s`` seconds of work in ``eval_section`` (an evaluation inside the step:
    by the main thread, or with ``eval_in_child`` by a child process the main thread waits for).
    """
    rep = ProgressReporter(run_dir, rank)
    step = 0
    steps = plan.get("steps")
    while (steps is None or step < steps) and not (stop is not None and stop.is_set()):
        for section in ("data", "forward", "backward", "all-reduce", "optimizer"):
            rep.enter(section, step)
            if step == plan.get("hang_at") and section == plan.get("hang_section", "forward"):
                _hang(plan)
            if step == plan.get("eval_at") and section == plan.get("eval_section", "forward"):
                _evaluate(plan)
            if section == "all-reduce":
                if barrier is not None:
                    try:
                        barrier.wait(timeout=30)
                    except threading.BrokenBarrierError:
                        return
                continue
            factor = plan.get("slow_factor", 1.0) if (
                rank == plan.get("slow_rank") and step >= plan.get("slow_from", 0)) else 1.0
            time.sleep(WORK[section] * factor)
        step += 1
    rep.enter("between-steps", step)
    rep.close()


def _evaluate(plan: dict[str, Any]) -> None:
    """Real work that takes ``eval_s`` seconds and then returns (the section makes no progress meanwhile)."""
    seconds = float(plan["eval_s"])
    if plan.get("eval_in_child"):
        import subprocess

        busy = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: sum(range(1000))"
        subprocess.run([sys.executable, "-c", busy], check=True, timeout=seconds + 60)
        return
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def _hang(plan: dict[str, Any]) -> None:
    kind = plan["hang"]
    if plan.get("ticks") is not None:
        ticks = plan["ticks"]

        def tick() -> None:  # a heartbeat thread: keeps running while the main thread hangs
            while True:
                with ticks.get_lock():
                    ticks.value += 1
                time.sleep(0.01)

        threading.Thread(target=tick, name="heartbeat", daemon=True).start()
    if kind == "spin":
        sum(range(10**15))  # C loop, holds the GIL: no other thread runs
    elif kind == "block-data":
        r, _w = os.pipe()
        os.read(r, 1)  # a data loader that never delivers
    elif kind == "self-stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    raise AssertionError(f"hang {kind!r} returned")


def gloo_rank(run_dir: str, rank: int, world: int, port: int, stop_at: int, result: Any) -> None:
    """A real gloo rank: all-reduce per step; rank 1 stops itself in "forward" at ``stop_at``."""
    import datetime

    import torch
    import torch.distributed as dist

    rep = ProgressReporter(run_dir, rank)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    t = torch.ones(1000)
    step = 0
    try:
        while True:
            rep.enter("forward", step)
            if rank == 1 and step == stop_at:
                os.kill(os.getpid(), signal.SIGSTOP)
            rep.enter("all-reduce", step)
            dist.all_reduce(t)
            step += 1
    except Exception as e:  # noqa: BLE001 - the peer was killed: this is what recovery sees
        rep.enter("recovery", step)
        result.send(type(e).__name__)
    os._exit(0)


if __name__ == "__main__":
    sys.exit("run through the tests")


def hammer_slot(run_dir: str, started: Any, stop: Any) -> None:
    """Enters sections as fast as it can until ``stop`` is set: the writer side of the seqlock test."""
    rep = ProgressReporter(run_dir, 0)
    sections = ("data", "forward", "backward", "all-reduce", "optimizer")
    step = 0
    started.set()
    while not stop.is_set():
        for section in sections:
            rep.enter(section, step)
        step += 1
    rep.close()
