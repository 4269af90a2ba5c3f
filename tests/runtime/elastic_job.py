"""A many-node job's nodes on one machine (``--nnodes MIN:MAX`` or ``N``, spare nodes): one agent per node on
127.0.0.1, each in its own session, so a test can start a node, take it down with everything on it, stop its
agent alone, and start it again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from jobs import GPT, REPO, SMALL_GPT, Job, free_port

from monitors.events import read_events


class ElasticJob:
    def __init__(self, run_dir: Path, *, nodes: str = "1:2", nproc: int = 2, steps: int = 200,
                 extra: list[str] | None = None, agent_args: list[str] | None = None, last_call_s: float = 1.0,
                 node_timeout_s: float = 2.0) -> None:
        self.run_dir, self.nodes, self.nproc, self.steps = run_dir, nodes, nproc, steps
        self.port = free_port()
        self.extra, self.agent_args = extra or [], agent_args or []
        self.last_call_s, self.node_timeout_s = last_call_s, node_timeout_s
        self.agents: dict[str, subprocess.Popen] = {}

    def command(self, node_rank: int | None) -> list[str]:
        node = ["--spare"] if node_rank is None else ["--node-rank", str(node_rank)]
        return [sys.executable, "-m", "resilient_train.cli", "run", "--nnodes", self.nodes,
                "--nproc-per-node", str(self.nproc), *node, "--master-addr", "127.0.0.1",
                "--master-port", str(self.port), "--rdzv-id", "elastic", "--run-dir", str(self.run_dir),
                "--rdzv-conf", f"last_call_timeout={self.last_call_s}", "--node-timeout", str(self.node_timeout_s),
                *self.agent_args, str(GPT), "--steps", str(self.steps), *SMALL_GPT, *self.extra]

    def start(self, name: str, node_rank: int | None) -> subprocess.Popen:
        """Starts node ``node_rank``'s agent (None: a spare node's)."""
        p = subprocess.Popen(self.command(node_rank), cwd=REPO, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
        self.agents[name] = p
        return p

    def kill(self, name: str) -> None:
        """The node's host dies: its agent and every process it started, at once."""
        os.killpg(self.agents[name].pid, signal.SIGKILL)
        self.agents[name].wait(timeout=30)

    def signal(self, name: str, signum: int) -> None:
        """A signal to the node's agent alone (SIGSTOP, SIGCONT: its ranks run on)."""
        os.kill(self.agents[name].pid, signum)

    def wait(self, name: str, timeout: float = 240) -> Job:
        p = self.agents[name]
        out, err = p.communicate(timeout=timeout)
        return Job(p.returncode, out, err, self.run_dir)

    def events(self) -> list[dict[str, Any]]:
        return list(read_events(self.run_dir)) if (self.run_dir / "events.jsonl").exists() else []

    def wait_event(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 150,
                   running: tuple[str, ...] = ("node0",)) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if predicate(e):
                    return e
            for name in running:
                p = self.agents[name]
                assert p.poll() is None, f"agent {name} exited early ({p.returncode}): {p.communicate()[1][-3000:]}"
            time.sleep(0.05)
        raise AssertionError("timed out waiting for an event")

    def close(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def step_at_least(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "step_done" and e["step"] >= n


def width(events: list[dict[str, Any]]) -> list[tuple[int, str, list[int]]]:
    """Every width change the ranks saw: (generation, cause, members)."""
    return [(e["generation"], e["cause"], e["members"]) for e in events if e["event"] == "width_changed"]


_ = json  # events are JSON lines
