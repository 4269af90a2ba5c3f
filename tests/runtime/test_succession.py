"""Issue 33, no single point of failure: losing node 0 is losing a node.

Nodes on this machine (one agent per node on 127.0.0.1, each in its own session: tests/runtime/elastic_job.py).
Node 0's agent hosts the store; when it is lost, the others move to the first successor alive, which opens a
store of its own with a majority of the last generation's agents (resilient_train.protocol.succession). Every test that
goes on ends bitwise equal to a fault-free run (``ckpt diff``). Partitions with real addresses are in
tests/cluster/test_netns_succession.py.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from elastic_job import ElasticJob, step_at_least
from jobs import REPO, ckpt_diff, console_lines, run_gpt

STEPS = 80
LONG = 800  # steps: the ranks train on while the store moves (some 45 steps a second, the move 6 s or more)
FIXED = ["--rdzv-conf", "last_call_timeout=1"]


@pytest.fixture
def cluster(tmp_path):
    made: list[ElasticJob] = []

    def make(**kw) -> ElasticJob:
        kw.setdefault("nproc", 1)
        kw.setdefault("steps", STEPS)
        job = ElasticJob(tmp_path / f"run{len(made)}", **kw)
        made.append(job)
        return job

    yield make
    for job in made:
        job.close()


def _moves(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "store_moved"]


def _verify_every_checkpoint(run_dir) -> list[int]:
    """Every committed step verifies (a staging directory is never one), and ``latest`` names the newest."""
    root = run_dir / "checkpoints"
    p = subprocess.run([sys.executable, "-m", "resilient_train.cli", "ckpt", "verify", str(root)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    steps = sorted(int(line.split("(step ")[1].split(",")[0]) for line in p.stdout.splitlines()
                   if line.startswith("OK"))
    assert (root / "latest").read_text().strip() == f"step-{steps[-1]}", steps
    return steps


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_node_0_killed_whole_the_store_moves_the_spare_takes_its_rank_and_the_run_is_bitwise(cluster, references):
    """3 nodes x 1 rank and a spare node; node 0's host dies at a random step (its agent, which hosts the store,
    and its rank SIGKILLed at once) while a checkpoint is often in flight (one every 2 steps, from the writer
    process). Node 1 opens the next store with 3 of the 4 agents, hands node 0 to the spare, and the spare's
    warm replacement heals from a live replica; every surviving agent exits 0."""
    job = cluster(nodes="3", agent_args=FIXED, extra=["--ckpt-every", "2"])
    for n in range(3):
        job.start(f"node{n}", n)
    job.start("spare", None)
    job.wait_event(lambda e: e["event"] == "spare_ready" and e["source"] == "agent-spare",
                   running=("node0", "node1", "node2", "spare"))
    kill_at = random.Random(33).randint(10, 40)
    job.wait_event(step_at_least(kill_at), running=("node0", "node1", "node2", "spare"))
    killed_at = time.time()
    job.kill("node0")
    for name in ("node1", "node2", "spare"):
        done = job.wait(name)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        assert len([line for line in console_lines(done.stderr) if "lost the store" in line]) == 1, \
            done.stderr[-2000:]
    events = job.events()
    moves = _moves(events)
    assert sorted(e["source"] for e in moves) == ["agent-spare", "agent1", "agent2"]
    assert {(e["epoch"], e["endpoint"]) for e in moves} == {(1, moves[0]["endpoint"])}  # one store, one epoch
    assert [e["hosting"] for e in moves if e["source"] == "agent1"] == [True]  # the first successor
    assert {tuple(e["voters"]) for e in moves} == {(0, 1, 2, 3)} and all(len(e["present"]) == 3 for e in moves)
    [lost] = [e for e in events if e["event"] == "node_lost"]
    assert (lost["node"], lost["spare"], lost["store_host"], lost["source"]) == (0, 0, True, "agent1")
    [spawned] = [e for e in events if e["event"] == "worker_spawned" and e["source"] == "agent-spare"]
    assert spawned["warm"] and spawned["replacement"]  # the spare's warm interpreter, healed from a replica
    healed = [e for e in events if e["event"] == "healed" and e["rank"] == 0 and e["time"] > killed_at]
    assert healed, "rank 0's replacement healed from a live replica, not from disk"
    # A save in flight when node 0 died was not committed; the next ones were, and every one verifies.
    committed_after = [e for e in events if e["event"] == "checkpoint_committed" and e["time"] > moves[0]["time"]]
    assert committed_after
    assert STEPS in _verify_every_checkpoint(job.run_dir)
    d = ckpt_diff(references.get(3, STEPS), job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_node_0s_agent_stopped_past_the_node_timeout_is_fenced_when_it_runs_again(cluster, references):
    """Node 0's agent alone is stopped (SIGSTOP: the store lives in it; its rank runs on) for longer than the
    others' store calls wait: they move on without it. Continued, it finds itself in a minority (every other
    agent's beat gone from its store) and exits 94 with its rank; its rank did nothing after the move. The run
    is long: the ranks train on while node 0's agent is stopped (80 and then 300 steps ended before the move)."""
    job = cluster(nodes="3", agent_args=FIXED, steps=LONG)
    for n in range(3):
        job.start(f"node{n}", n)
    job.start("spare", None)
    job.wait_event(lambda e: e["event"] == "spare_ready" and e["source"] == "agent-spare",
                   running=("node0", "node1", "node2", "spare"))
    job.wait_event(step_at_least(random.Random(330).randint(10, 40)), running=("node0", "node1", "node2", "spare"))
    old_rank0 = [e["pid"] for e in job.events() if e["event"] == "run_start" and e["rank"] == 0]
    job.signal("node0", signal.SIGSTOP)
    moved = job.wait_event(lambda e: e["event"] == "store_moved", running=("node1", "node2", "spare"))
    new_start = job.wait_event(lambda e: e["event"] == "run_start" and e["rank"] == 0 and e["pid"] not in old_rank0,
                               running=("node1", "node2", "spare"))
    job.signal("node0", signal.SIGCONT)
    stopped = job.wait("node0", timeout=60)
    assert stopped.returncode == 94, stopped.stderr[-3000:]
    [line] = console_lines(stopped.stderr)
    assert "no majority" in line and "exit code 94" in line, line
    assert subprocess.run(["kill", "-0", str(old_rank0[0])], capture_output=True).returncode != 0  # gone
    for name in ("node1", "node2", "spare"):
        done = job.wait(name)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    events = job.events()
    # The old rank 0 did nothing on its own after the move: what it did before the others read their agent's
    # announcement (within a fifth of a second) it did with them, in the old generation, and they carried
    # it into the new one. No write either: a checkpoint's commit needs the stopped host's store.
    old = [e for e in events if e["source"] == "rank0" and moved["time"] < e["time"] < new_start["time"]]
    [healed] = [e for e in events if e["event"] == "healed" and e["rank"] == 0 and e["time"] > new_start["time"]]
    for e in old:  # steps the whole old generation committed: the new rank 0 starts from them, or past them
        assert e["event"] == "step_done" and e["generation"] < healed["generation"], e
        assert e["step"] <= healed["step"], (e, healed)
    [end] = [e for e in events if e["event"] == "agent_end" and e["source"] == "agent0"]
    assert (end["reason"], end["exit_code"]) == ("fenced", 94)
    d = ckpt_diff(references.get(3, LONG), job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(300)
def test_two_nodes_without_a_spare_stop_with_75_in_one_line_when_node_0_dies(cluster):
    """Node 1 alone is half of the last generation and does not hold the store: no majority. Node 0's port
    refuses (its process is gone, not cut off): the job stops to be resumed (75), in one line."""
    job = cluster(nodes="2", agent_args=FIXED)
    job.start("node0", 0)
    job.start("node1", 1)
    job.wait_event(step_at_least(10), running=("node0", "node1"))
    job.kill("node0")
    done = job.wait("node1")
    assert done.returncode == 75, done.stderr[-3000:]
    [line] = console_lines(done.stderr)
    assert "no other agent of the job answers" in line and "start the job again to resume" in line, line


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_elastic_job_that_loses_node_0_shrinks_and_ends_bitwise(cluster, tmp_path_factory):
    """--nnodes 1:3, one rank each: node 0 lost with no spare, nodes 1 and 2 (a majority) open the next store,
    and their ranks compute node 0's logical rank too; the run ends equal to 3 ranks from the start."""
    ref = run_gpt(tmp_path_factory.mktemp("succession-ref") / "run", nproc=3, steps=STEPS,
                  agent_args=["--supervisor.ordered_reduction=true"], timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    job = cluster(nodes="1:3")
    for n in range(3):
        job.start(f"node{n}", n)
    job.wait_event(step_at_least(random.Random(331).randint(10, 40)), running=("node0", "node1", "node2"))
    job.kill("node0")
    for name in ("node1", "node2"):
        done = job.wait(name)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    events = job.events()
    shrunk = [e for e in events if e["event"] == "width_changed" and e["processes"] == 2]
    assert shrunk and shrunk[-1]["members"] == [1, 2]
    assert sorted(shrunk[-1]["logical"]["1"] + shrunk[-1]["logical"]["2"]) == [0, 1, 2]
    d = ckpt_diff(ref.run_dir / "final", job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr
