"""A lost node: a spare node taking over against a restart of every node from the newest checkpoint.

Both on one machine, 2 nodes x ``--nproc`` ranks of the example GPT, node 1's
agent and its ranks SIGKILLed (its host dies) once step ``--kill-step`` is done:

* spare: a third agent started with ``--spare`` takes node 1 over; it keeps a
  warm interpreter per local rank while it waits (resilient_train.agent.spares), so
  each of node 1's ranks starts warm; they heal from live replicas
  (``--node-timeout`` is the detection time);
* spare0: the same, but node 0 is lost, whose agent hosts the store (issue 33):
  the store moves to node 1's standby store (node 1 and the spare: 2 of the 3
  agents) and the spare takes node 0 over;
* shrink: no spare, an elastic job (``--nnodes 1:2``, issue 32): node 0's ranks take node 1's logical ranks
  over at once, without a process start, and the job goes on at half the width;
* restart: what a torchrun job does: every node's agent is stopped and started
  again at once (an instant scheduler), and the job resumes from the newest
  checkpoint, saved synchronously every ``--ckpt-every`` steps.

Reported per run: seconds from the kill to the next completed step, steps
redone, and (spare) how many of the node's replacements started warm and how
long after their spawn each ran the script; runs alternate. The machine's load
average is printed beside the figures.

    python bench/node_loss.py --repeats 3              # 2 nodes x 2 ranks
    python bench/node_loss.py --repeats 3 --modes spare
    python bench/node_loss.py --repeats 3 --modes spare,spare0,restart --nproc 1
    python bench/node_loss.py --repeats 3 --modes shrink,spare,restart --nproc 1
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

from jobfiles import events, free_port

REPO = Path(__file__).resolve().parent.parent
MODEL = ["--d-model", "64", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "4", "--log-every", "0"]


def _agent(run: Path, port: int, args: argparse.Namespace, *, node: int | None, extra: list[str],
           nnodes: str = "2") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nnodes", nnodes, "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-id", "bench", "--run-dir", str(run),
           "--node-timeout", str(args.node_timeout)]
    cmd += ["--spare"] if node is None else ["--node-rank", str(node)]
    cmd += [str(REPO / "examples" / "train_gpt.py"), "--steps", str(args.steps), *MODEL, *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_step(run: Path, step: int, timeout: float, after: float = 0.0, marker: str | None = None) -> dict:
    """The first step done after ``after`` (and after the first ``marker`` event since then, if given).

    The marker (the survivors' recovery, or the restarted job's first rank) keeps a step that was
    finishing as the node died from counting as the next one.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = marker is None
        for e in events(run):
            if e["time"] <= after:
                continue
            seen = seen or e["event"] == marker
            if seen and e["event"] == "step_done" and e["step"] > step:
                return e
        time.sleep(0.02)
    raise RuntimeError(f"no step after {step} within {timeout} s")


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def one(mode: str, work: Path, n: int, args: argparse.Namespace) -> tuple[float, int, str]:
    run, port = work / f"{mode}-{n}", free_port()
    # The baseline's checkpoints are synchronous: an async save still in flight would skip the next ones.
    extra = ["--ckpt-every", str(args.ckpt_every), "--ckpt-mode", "disabled"] if mode == "restart" else []
    nnodes = "1:2" if mode == "shrink" else "2"
    agents = [_agent(run, port, args, node=r, extra=extra, nnodes=nnodes) for r in (0, 1)]
    if mode in ("spare", "spare0"):
        agents.append(_agent(run, port, args, node=None, extra=extra))
    try:
        _wait_step(run, args.kill_step - 1, timeout=args.timeout)
        killed = time.time()
        _kill(agents[0] if mode == "spare0" else agents[1])  # node 1's host dies (spare0: node 0's)
        if mode == "restart":
            _kill(agents[0])
            port = free_port()
            agents = [_agent(run, port, args, node=0, extra=extra), _agent(run, port, args, node=1, extra=extra)]
        last_done = max(e["step"] for e in events(run) if e["event"] == "step_done" and e["time"] <= killed)
        nxt = _wait_step(run, 0, timeout=args.timeout, after=killed,
                         marker="run_start" if mode == "restart" else "recovery_done")
        if mode == "restart":
            resumed = [e["step"] for e in events(run) if e["event"] == "resumed_from_disk" and e["time"] > killed]
            redone = last_done - (resumed[0] if resumed else 0)
        else:
            recs = [e for e in events(run) if e["event"] == "recovery_done" and e["time"] > killed]
            redone = max((e.get("steps_redone", 0) for e in recs), default=0)
        for p in agents:  # the killed one was reaped by _kill
            p.wait(timeout=args.timeout)
        since = [e for e in events(run) if e["time"] > killed]
        spawned = [e for e in since if e["event"] == "worker_spawned" and e.get("replacement")]
        started = [e["since_spawn_s"] for e in since if e["event"] == "run_start" and e.get("replacement")]
        how = (f"{sum(bool(e.get('warm')) for e in spawned)} of {len(spawned)} warm, script after "
               + ", ".join(f"{t:.2f}" for t in sorted(started)) + " s") if mode in ("spare", "spare0") else ""
        return nxt["time"] - killed, redone, how
    finally:
        for p in agents:
            _kill(p)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--modes", default="spare,restart", help="which recoveries to run: spare, spare0, shrink, restart")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=25)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--node-timeout", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=240.0)
    args = p.parse_args()
    modes = [m for m in ("spare", "spare0", "shrink", "restart") if m in args.modes.split(",")]
    if not modes:
        p.error("--modes: any of spare, spare0, shrink, restart, comma-separated")
    results: dict[str, list[tuple[float, int, str]]] = {m: [] for m in modes}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="rt-nodeloss-") as tmp:
        for n in range(args.repeats):
            for mode in modes:
                r = one(mode, Path(tmp), n, args)
                results[mode].append(r)
                load.append(os.getloadavg()[0])
                print(f"  {mode:8} run {n}: {r[0]:.2f} s, {r[1]} steps redone {r[2]}", file=sys.stderr, flush=True)
    print(f"2 nodes x {args.nproc} ranks; load average (1 min) {min(load):.1f} to {max(load):.1f} over the runs")
    print("| after a node loss | kill → next step, s (median; runs) | steps redone |")
    print("|---|---|---|")
    med = {}
    labels = {"spare": f"spare node, heal from live replicas (node timeout {args.node_timeout:g} s)",
              "spare0": "node 0 lost: the store moves to node 1, the spare takes node 0, heal from live replicas",
              "shrink": "no spare, elastic (--nnodes 1:2): node 0 computes node 1's logical ranks too",
              "restart": f"restart every node from the newest checkpoint (every {args.ckpt_every})"}
    for mode in modes:
        ts = [t for t, _, _ in results[mode]]
        med[mode] = statistics.median(ts)
        print(f"| {labels[mode]} | {med[mode]:.2f} ({', '.join(f'{t:.2f}' for t in ts)}) | "
              f"{max(r for _, r, _ in results[mode])} |")
    for mode in ("spare", "spare0", "shrink"):
        if mode in med and "restart" in med:
            print(f"| ratio {mode} / restart | {med[mode] / med['restart']:.2f}× | |")
    if "spare" in med and "spare0" in med:
        print(f"| ratio spare0 / spare (losing the store's host against another node) | "
              f"{med['spare0'] / med['spare']:.2f}× | |")


if __name__ == "__main__":
    main()
