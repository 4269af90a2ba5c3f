"""A many-node job whose agents run on the nodes of a :class:`~cluster.netns.Network`, each at its own address.

Node 0's agent hosts the store on its node's address (``--master-addr``), on
torchrun's default port (every node has its own ports: nothing else on the
machine can take them); every other agent, the spare's included, reaches it
over the bridge. The helpers mirror tests/runtime/test_nodes.py's ``Cluster``
(a test there reads the same here), plus :class:`RankCensus`, which watches
that no rank ever has two live processes (a fenced one and its replacement).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from cluster.netns import Network, Node, alive
from jobs import GPT, REPO, SMALL_GPT, Job, events_now

__all__ = ["NetCluster", "RankCensus"]

PORT = 29500  # torchrun's default: each node's namespace has ports of its own
# The ranks of a node behind a cut link, or blocked by a fault, make no progress: neither the lost node's agent
# nor node 0's (whose rank waits on it) may kill them as hung before the loss plays out.
MONITOR = {"hang": {"idle_timeout_s": 60.0}, "metrics": {"prometheus": False}}


class NetCluster:
    """The agents of one job on ``network``'s nodes: ``nnodes`` nodes of ``nproc`` ranks, the GPT example."""

    def __init__(self, network: Network, run_dir: Path, *, nnodes: int, steps: int, nproc: int = 1,
                 node_timeout: float = 2.0, chaos: list[dict[str, Any]] | None = None,
                 extra: list[str] | None = None, agent_args: list[str] | None = None) -> None:
        self.network, self.run_dir, self.nnodes, self.steps, self.nproc = network, run_dir, nnodes, steps, nproc
        self.node_timeout, self.chaos = node_timeout, chaos
        self.extra, self.agent_args = extra or [], agent_args or []
        self.master = next(iter(network.nodes.values()))  # the network's first node serves node 0
        self.agents: dict[str, subprocess.Popen] = {}
        self.nodes: dict[str, Node] = {}
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self._monitor = run_dir.parent / f"{run_dir.name}.monitor.json"
        self._monitor.write_text(json.dumps(MONITOR))

    def command(self, *, node_rank: int | None = None, spare: bool = False, args: Iterable[str] = ()) -> list[str]:
        cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nnodes", str(self.nnodes),
               "--nproc-per-node", str(self.nproc), "--master-addr", self.master.address, "--master-port",
               str(PORT), "--rdzv-id", "netns-job", "--run-dir", str(self.run_dir), "--node-timeout",
               str(self.node_timeout), "--monitor-config", str(self._monitor)]
        cmd += ["--spare"] if spare else ["--node-rank", str(node_rank)]
        if self.chaos:
            cmd += ["--chaos", json.dumps(self.chaos)]
        cmd += [*self.agent_args, *args]
        return [*cmd, str(GPT), "--steps", str(self.steps), *SMALL_GPT, *self.extra]

    def start(self, node: Node, *, node_rank: int | None = None, spare: bool = False,
              args: Iterable[str] = ()) -> subprocess.Popen:
        """Starts an agent on ``node`` (known by the node's name), with ``args`` of its own; node 0's must be on
        the first node."""
        assert spare or node_rank is not None
        assert node_rank != 0 or node is self.master, "node 0's agent serves the store on the first node's address"
        p = node.popen(self.command(node_rank=node_rank, spare=spare, args=args), cwd=REPO, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
        self.agents[node.name] = p
        self.nodes[node.name] = node
        return p

    def wait(self, name: str, timeout: float = 150) -> Job:
        p = self.agents[name]
        out, err = p.communicate(timeout=timeout)
        return Job(p.returncode, out, err, self.run_dir)

    def events(self) -> list[dict[str, Any]]:
        return events_now(self.run_dir)

    def wait_event(self, predicate: Callable[[dict[str, Any]], bool], *, timeout: float = 120,
                   running: Iterable[str] | None = None) -> dict[str, Any]:
        """The first event for which ``predicate`` holds; fails at ``timeout``, or at once when an agent named
        in ``running`` (default: every agent) exited meanwhile."""
        watched = list(self.agents) if running is None else list(running)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = {name: self.agents[name].poll() for name in watched}  # before the read: no last event missed
            for e in self.events():
                if predicate(e):
                    return e
            for name, rc in ended.items():
                if rc is not None:
                    raise AssertionError(f"agent {name} exited early ({rc}): {self.agents[name].communicate()[1][-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no such event in {timeout} s")


class RankCensus:
    """Counts, every 50 ms on a thread, the live processes of each rank (their pids from run_start events)."""

    def __init__(self, cluster: NetCluster) -> None:
        self.cluster, self.most = cluster, 0
        self.overlaps: list[tuple[int, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-census", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            pids: dict[int, set[int]] = {}
            for e in self.cluster.events():
                if e["event"] == "run_start":
                    pids.setdefault(e["rank"], set()).add(e["pid"])
            for rank, ps in pids.items():
                live = sorted(p for p in ps if alive(p))
                self.most = max(self.most, len(live))
                if len(live) > 1:
                    self.overlaps.append((rank, live))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
