"""The coordination protocol at scale: N simulated ranks on one real TCPStore, without N training processes.

Each simulated rank is a thread with its own TCPStore client (and its own
:class:`GenerationWatcher`, with the watcher's own connection), in one of a few
client processes; the store server runs in a process of its own so its CPU time
and bytes can be read from ``/proc``. The ranks call the runtime's own protocol
code, the functions the supervisor calls (``resilient_train.rank.rendezvous``): they
join generation 0, take steady steps (each publishes its local state through
:class:`LocalSlots`, as the stepper does at its vote), then lose one rank, and
later 1% of the ranks: the agent declares the fault, warm replacements join,
every rank agrees on the plan.

    PYTHONPATH=$PWD python bench/coordination.py --sizes 64,256,1024,4096

What a generation change measures: from the agent's ``declare_fault`` to the
last rank's watcher seeing it (seen), to the last rank's membership sent
(joined), to the planner (rank 0) writing the plan (planned), to the last rank
holding it (plan). Not in it: building the new process
group (gloo's own rendezvous), healing, a replacement's process start.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from resilient_train.rank import rendezvous
from resilient_train.rank.generation import RankMembership, ResumePlan
from resilient_train.rank.local_state import LocalSlots, encode_local
from resilient_train.protocol.store import attempt_store, job_store
from resilient_train.rank.train_state import capture_rng
from resilient_train.rank.watch import GenerationWatcher

__all__ = ["BenchConfig", "CountingStore", "run_size", "main"]

TOKEN = "bench"


class CountingStore:
    """A real store, its requests counted (the protocol's store calls go through it unchanged)."""

    def __init__(self, inner: dist.Store, tally: "Tally") -> None:
        self._inner, self._t = inner, tally

    def _n(self, *parts: Any, trips: int = 1) -> None:
        self._t.ops += 1
        self._t.trips += trips
        self._t.bytes += sum(len(p) if isinstance(p, (str, bytes)) else 8 for p in parts)

    def set_timeout(self, timeout: timedelta) -> None:  # the client's own setting: no request
        self._inner.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._n(key, value)
        self._inner.set(key, value)
        if "/member/" in key:
            self._t.joined_at = time.monotonic()
        elif key.endswith("/outcome"):
            self._t.planned_at = time.monotonic()

    def get(self, key: str) -> bytes:
        v = self._inner.get(key)
        self._n(key, v, trips=2)  # TCPStore's get is a wait, then the get
        return v

    def add(self, key: str, amount: int) -> int:
        self._n(key, amount)
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        v = self._inner.compare_set(key, expected, desired)
        self._n(key, expected, desired, v)
        return v

    def check(self, keys: list[str]) -> bool:
        self._n(*keys)
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._n(*keys)
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        vs = self._inner.multi_get(keys)
        self._n(*keys, *vs, trips=2)
        return vs

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._n(*keys, *values)
        self._inner.multi_set(keys, values)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout

    def clone(self) -> "CountingStore":
        return CountingStore(self._inner.clone(), self._t)


@dataclass
class Tally:
    ops: int = 0  # calls of the store's methods
    trips: int = 0  # request-reply exchanges on the wire (a get is two: TCPStore waits for the key first)
    bytes: int = 0
    joined_at: float = 0.0
    planned_at: float = 0.0  # the planner wrote the outcome


RANKS_PER_PROC = 128  # a thousand threads in one process make its GIL the bottleneck (seen at 4,096 ranks)


@dataclass(kw_only=True)
class BenchConfig:
    world_size: int
    procs: int = 0  # client processes; 0: one per RANKS_PER_PROC simulated ranks, at least 4
    steady_steps: int = 5
    step_s: float = 1.0
    watch_interval_s: float = 0.05  # SupervisorConfig's default
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.procs <= 0:
            self.procs = max(4, math.ceil(self.world_size / RANKS_PER_PROC))


@dataclass(eq=False)
class SimRank:
    """One simulated rank: the supervisor's store calls, in its order, without the training."""

    rank: int
    cfg: BenchConfig
    port: int
    replacement: bool = False
    tally: Tally = field(default_factory=Tally)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def connect(self) -> None:
        raw = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=self.cfg.timeout_s))
        self.store = CountingStore(attempt_store(job_store(raw, TOKEN), 0), self.tally)
        self.slots = LocalSlots(self.store)
        self.seen_at = 0.0
        self.watcher = GenerationWatcher(self.store, rank=self.rank, interval_s=self.cfg.watch_interval_s,
                                         on_moved=self._on_moved)
        self.live: int | None = None if self.replacement else 0
        self.fresh = not self.replacement
        self.new_process = True
        self.moved_to: int | None = None

    def _on_moved(self) -> None:
        self.seen_at = time.monotonic()

    def join(self, phase: str) -> ResumePlan:
        def me() -> RankMembership:
            return RankMembership(rank=self.rank, pid=os.getpid(), live_step=self.live, snapshot_step=None,
                              local_steps=self.slots.steps(self.rank), replacement=self.replacement,
                              fresh=self.fresh, new_process=self.new_process)

        moved_to, self.moved_to = self.moved_to, None
        plan = rendezvous.enter_generation(self.store, world_size=self.cfg.world_size, me=me,
                                           timeout=self.cfg.timeout_s, stopped=lambda: None, moved_to=moved_to)
        self.watcher.watch(plan.generation)
        t = time.monotonic()
        self.fresh = self.new_process = False
        self.live = plan.step if plan.step is not None else 0
        self.results[phase] = {"seen": self.seen_at, "joined": self.tally.joined_at, "planned": self.tally.planned_at,
                               "plan": t,
                               "held": plan}  # digested after the change, outside its time
        return plan

    def recover(self) -> None:
        """What a recovery's judge and leave do with the store (resilient_train.rank.recovery): read a stop, report
        the fault (a woken rank does neither: it joins the next generation, which tells)."""
        if rendezvous.stop_after_failure(self.store, self.watcher) is not None:
            raise RuntimeError("the bench's job was stopped")
        g = self.watcher.generation
        _, _, self.moved_to = rendezvous.leave_generation(
            self.store, g, {"rank": self.rank, "kind": "GenerationFailed", "time": time.time()},
            world_size=self.cfg.world_size, watcher=self.watcher)

    def step(self, step: int, payload: bytes) -> None:
        self.slots.publish(self.rank, step, payload)  # the stepper's publish at its vote
        self.live = step


def _digest(plan: ResumePlan) -> str:
    return json.dumps([plan.generation, plan.source.value, plan.step, sorted(plan.heal_from.items()),
                       plan.from_snapshot, plan.replacements])


def _reported(result: dict[str, Any] | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {k: v for k, v in result.items() if k != "held"} | {"digest": _digest(result["held"])}


def _local_payload(step: int) -> bytes:
    """A rank-local state as a TrainState's (its RNG states, captured by the same function), encoded as published."""
    __import__("numpy")  # a script that imports NumPy has its RNG state captured too
    return encode_local({"step": step, "rng": capture_rng()})


# ------------------------------------------------------------------ client process
def _guard(fn: Any, s: SimRank, errors: list[str]) -> None:
    try:
        fn(s)
    except BaseException as e:  # noqa: BLE001  (reported to the bench, which fails the run)
        errors.append(f"rank {s.rank}: {type(e).__name__}: {e}")


def _main_thread(s: SimRank, jobs: "queue.SimpleQueue[Any]", errors: list[str]) -> None:
    """A simulated rank's main thread: it lives as long as the rank, as a training process's does (a thread
    started and ended per command would put 4,096 thread exits inside the change), and runs what it is handed."""
    while (job := jobs.get()) is not None:
        fn, done = job
        _guard(fn, s, errors)
        done.release()


def _client(idx: int, cfg: BenchConfig, port: int, ranks: list[int], spares: list[int], conn: Any) -> None:
    """A client process: one thread per simulated rank, driven by commands from the bench over ``conn``."""
    threading.stack_size(256 * 1024)
    # Hundreds of threads queue for the GIL after each store reply; each waiter wakes every switch interval to
    # ask for it (Python 3.11), which at 5 ms and a thousand threads is most of the CPU. The threads here
    # block in the store, not compute: a long interval costs them nothing.
    sys.setswitchinterval(0.05)
    sims = {r: SimRank(r, cfg, port) for r in ranks}
    spare_sims = {r: SimRank(r, cfg, port, replacement=True) for r in spares}
    # Connected in parallel: on this sandbox some connects stall for 5 s (name lookups); they overlap.
    with ThreadPoolExecutor(64) as pool:
        list(pool.map(SimRank.connect, [*sims.values(), *spare_sims.values()]))
    conn.send("connected")
    payload = _local_payload(0)
    errors: list[str] = []
    jobs: dict[SimRank, queue.SimpleQueue[Any]] = {}  # by rank object: a replacement has its rank's number
    for s in [*sims.values(), *spare_sims.values()]:
        jobs[s] = queue.SimpleQueue()
        threading.Thread(target=_main_thread, args=(s, jobs[s], errors), name=f"sim{s.rank}", daemon=True).start()
    armed = threading.Semaphore(0)  # released by each armed rank once it holds the plan
    n_armed = 0
    joining: list[SimRank] = []
    spawned = threading.Event()

    def hand(fn: Any, targets: list[SimRank], done: threading.Semaphore) -> None:
        for s in targets:
            jobs[s].put((fn, done))

    def wait_done(done: threading.Semaphore, n: int) -> None:
        deadline = time.monotonic() + cfg.timeout_s
        for _ in range(n):
            if not done.acquire(timeout=max(deadline - time.monotonic(), 0.001)):
                errors.append(f"client {idx}: a simulated rank did not finish in {cfg.timeout_s:.0f} s")
                return

    def run_all(fn: Any, targets: list[SimRank]) -> None:
        done = threading.Semaphore(0)
        hand(fn, targets, done)
        wait_done(done, len(targets))

    while True:
        cmd, arg = conn.recv()
        if cmd == "join":
            run_all(lambda s: s.join(arg), list(sims.values()))
        elif cmd == "steps":
            start, first, count = arg

            def steps(s: SimRank) -> None:
                for k in range(count):
                    delay = start + k * cfg.step_s - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    s.step(first + k, payload)
            run_all(steps, list(sims.values()))
        elif cmd == "die":
            for r in arg:
                if r in sims:
                    dead = sims.pop(r)
                    dead.watcher.close()
                    jobs[dead].put(None)  # its main thread ends with it
        elif cmd == "arm":  # each survivor's main thread waits for its watcher; each replacement for its spawn
            phase, lost = arg
            joining = [spare_sims.pop(r) for r in lost if r in spare_sims]
            spawned = threading.Event()

            def survive(s: SimRank) -> None:
                if not s.watcher.moved.wait(cfg.timeout_s):
                    raise TimeoutError("the fault was never seen")
                s.recover()
                s.join(phase)

            def replace(s: SimRank) -> None:
                if not spawned.wait(cfg.timeout_s):
                    raise TimeoutError("never spawned")
                s.join(phase)
            armed = threading.Semaphore(0)
            n_armed = len(sims) + len(joining)
            hand(survive, list(sims.values()), armed)
            hand(replace, joining, armed)
        elif cmd == "spawn":
            spawned.set()
        elif cmd == "settle":
            wait_done(armed, n_armed)
            for s in joining:
                s.replacement = False
                sims[s.rank] = s
        elif cmd == "tally":
            every = [*sims.values(), *spare_sims.values()]
            conn.send({"ops": sum(s.tally.ops for s in every), "trips": sum(s.tally.trips for s in every),
                       "bytes": sum(s.tally.bytes for s in every), "ranks": len(sims)})
            continue
        elif cmd == "results":
            conn.send({"errors": errors, "results": {s.rank: _reported(s.results.get(arg)) for s in sims.values()}})
            continue
        elif cmd == "exit":
            for s in sims.values():
                s.watcher.close()
                jobs[s].put(None)
            conn.send("bye")
            return
        conn.send("ok")


def _server(conn: Any) -> None:
    # The agent's kind of server (resilient_train.agent.storehost hosts it without libuv, on a socket it opened).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300),
                          use_libuv=False)
    attempt_store(job_store(store, TOKEN), 0).set("rt/generation", "0")
    conn.send(store.port)
    conn.recv()


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_io(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    return int(io["rchar"]) + int(io["wchar"])


class _Bench:
    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        # This sandbox's resolver is unreachable and TCPStore looks up socket names: a 5 s stall per timeout,
        # on some connects. Only setting up connections waits on it; 1 s is enough for it to give up.
        os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
        ctx = mp.get_context("fork")
        here, there = ctx.Pipe()
        self.server = ctx.Process(target=_server, args=(there,), daemon=True)
        self.server.start()
        self._server_conn = here
        port = here.recv()
        n = cfg.world_size
        lost_a, lost_b = self.lost_sets(n)
        spares = sorted({*lost_a, *lost_b})
        self.conns = []
        self.procs = []
        for i in range(cfg.procs):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_client, args=(i, cfg, port, [r for r in range(n) if r % cfg.procs == i],
                                                  [r for r in spares if r % cfg.procs == i], b), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for c in self.conns:
            assert c.recv() == "connected"
        raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
        self.agent_tally = Tally()
        self.agent = CountingStore(attempt_store(job_store(raw, TOKEN), 0), self.agent_tally)
        self.lost_a, self.lost_b = lost_a, lost_b

    @staticmethod
    def lost_sets(n: int) -> tuple[list[int], list[int]]:
        one = [n // 2 + 1]
        k = max(1, math.ceil(n / 100))
        return one, [(i * n) // k + 3 for i in range(k)]

    def send(self, cmd: str, arg: Any = None) -> list[Any]:
        for c in self.conns:
            c.send((cmd, arg))
        return [c.recv() for c in self.conns]

    def meter(self) -> dict[str, float]:
        t = self.send("tally")
        return {"t": time.monotonic(), "cpu": _proc_cpu(self.server.pid), "io": _proc_io(self.server.pid),
                "client_cpu": sum(_proc_cpu(p.pid) for p in self.procs),
                "ops": sum(x["ops"] for x in t) + self.agent_tally.ops,
                "trips": sum(x["trips"] for x in t) + self.agent_tally.trips,
                "bytes": sum(x["bytes"] for x in t) + self.agent_tally.bytes}

    def results(self, phase: str) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for r in self.send("results", phase):
            if r["errors"]:
                raise RuntimeError(f"{len(r['errors'])} simulated ranks failed; first: {r['errors'][0]}")
            out.update(r["results"])
        return out

    def close(self) -> None:
        self.send("exit")
        self._server_conn.send("exit")
        for p in [*self.procs, self.server]:
            p.join(10)


def _delta(a: dict[str, float], b: dict[str, float], n: int) -> dict[str, float]:
    # Bytes: keys and values as the clients send and receive them (the server's own socket counters in /proc miss
    # the send/recv of the agent's kind of TCPStore on this sandbox).
    return {"wall_s": b["t"] - a["t"], "server_cpu_s": b["cpu"] - a["cpu"], "ops_per_rank": (b["ops"] - a["ops"]) / n,
            "trips_per_rank": (b["trips"] - a["trips"]) / n,
            "client_cpu_s": b["client_cpu"] - a["client_cpu"],
            "server_io_bytes_per_rank": (b["io"] - a["io"]) / n, "payload_bytes_per_rank": (b["bytes"] - a["bytes"]) / n}


def _agreed(results: dict[int, dict[str, Any]], n: int) -> str:
    digests = {r["digest"] for r in results.values() if r is not None}
    if len(results) != n or None in results.values() or len(digests) != 1:
        raise AssertionError(f"{len(results)} ranks reported, {len(digests)} distinct plans")
    return digests.pop()


def _log(what: str) -> None:
    print(f"#   {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def run_size(cfg: BenchConfig) -> dict[str, Any]:
    """One world size through start, steady steps and two generation changes; the figures and the plans agreed."""
    n = cfg.world_size
    _log(f"N={n}: connecting")
    b = _Bench(cfg)
    _log(f"N={n}: connected")
    out: dict[str, Any] = {"world_size": n, "procs": cfg.procs}
    try:
        m0 = b.meter()
        b.send("join", "start")
        m1 = b.meter()
        _log(f"N={n}: joined generation 0")
        out["start"] = {**_delta(m0, m1, n), "plan": json.loads(_agreed(b.results("start"), n))}
        start = time.monotonic() + 0.2
        b.send("steps", (start, 1, cfg.steady_steps))
        m2 = b.meter()
        steady = _delta(m1, m2, n)
        out["steady"] = {k: v / cfg.steady_steps for k, v in steady.items()} | {"step_s": cfg.step_s}
        step = cfg.steady_steps
        _log(f"N={n}: steady steps done")
        for phase, lost in (("one_lost", b.lost_a), ("pct_lost", b.lost_b)):
            b.send("die", lost)
            b.send("arm", (phase, lost))
            ma = b.meter()
            t0 = time.monotonic()  # the agent: a worker died; it fails the generation, then spawns replacements
            rendezvous.report_fault(b.agent, int(b.agent.get("rt/generation")),
                                    {"rank": lost[0], "kind": "worker_exit", "time": time.time()}, world_size=n)
            b.send("spawn")
            b.send("settle")
            mb = b.meter()
            res = b.results(phase)
            plan = json.loads(_agreed(res, n))
            survivors = [r for r in res.values() if r["seen"] > 0]
            out[phase] = {
                **_delta(ma, mb, n), "lost": len(lost), "plan": plan,
                "seen_s": max(r["seen"] for r in survivors) - t0,
                "joined_s": max(r["joined"] for r in res.values()) - t0,
                "planned_s": max(r["planned"] for r in res.values()) - t0,
                "plan_s": max(r["plan"] for r in res.values()) - t0,
            }
            b.send("steps", (time.monotonic() + 0.1, step + 1, 1))
            step += 1
            _log(f"N={n}: {phase} done")
    finally:
        b.close()
        _log(f"N={n}: closed")
    return out


def _row(size: dict[str, Any]) -> str:
    a, c, s = size["one_lost"], size["pct_lost"], size["steady"]
    return (f"| {size['world_size']} | {a['seen_s']:.3f} / {a['joined_s']:.3f} / {a['planned_s']:.3f} / {a['plan_s']:.3f} "
            f"| {c['lost']}: {c['seen_s']:.3f} / {c['joined_s']:.3f} / {c['planned_s']:.3f} / {c['plan_s']:.3f} "
            f"| {a['ops_per_rank']:.1f} / {a['trips_per_rank']:.1f} / {a['payload_bytes_per_rank'] / 1e3:.1f} "
            f"| {a['server_cpu_s']:.2f} / {a['client_cpu_s']:.2f} "
            f"| {s['ops_per_rank']:.1f} / {s['payload_bytes_per_rank'] / 1e3:.1f} | {s['server_cpu_s']:.3f} "
            f"| {size['start']['wall_s']:.2f} |")


HEADER = ("| N | one lost: seen / joined / planned / plan (s) | 1% lost: k: seen / joined / planned / plan (s) "
          "| change: calls / round trips / KB per rank | change: CPU s, server / simulated ranks | per step: requests / KB per rank | per step: server CPU s "
          "| first join s |\n|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,256,1024,4096")
    p.add_argument("--procs", type=int, default=0,
                   help=f"client processes the simulated ranks are spread over (0: one per {RANKS_PER_PROC}, at least 4)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--json", default="", help="also write every figure to this file")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * max(sizes) + 512  # each simulated rank: its client socket and its watcher's
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    if min(need, hard) < need:
        print(f"warning: ulimit -n is {hard}; {max(sizes)} ranks need about {need} sockets", file=sys.stderr)
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    print(HEADER, flush=True)
    every = []
    for n in sizes:
        size = run_size(BenchConfig(world_size=n, procs=a.procs, steady_steps=a.steps, step_s=a.step_s))
        every.append(size)
        print(_row(size), flush=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at end", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(every, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
