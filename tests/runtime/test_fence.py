"""The fence of a lost node's ranks, and the agent's store deadline, against real processes and a real store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from jobs import REPO
from resilient_train.base import exitcodes
from resilient_train.protocol.nodes import NodeKeys

RANK = """
import sys
from datetime import timedelta
import torch.distributed as dist
from resilient_train.rank.fence import check_fence
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))
check_fence(store, "join")
print("took part", flush=True)
"""


SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
print(store.port, flush=True)
time.sleep(300)
"""


def _rank(port: int, run_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RANK, str(port)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "RANK": "3", "RT_RUN_DIR": str(run_dir), **env})


@pytest.mark.timeout(120)
def test_a_rank_of_a_lost_incarnation_acknowledges_its_fence_and_exits_94(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    node = {"RT_NODE": "1", "RT_NODE_INCARNATION": "2"}
    assert _rank(store.port, tmp_path, **node).stdout == "took part\n"  # not lost: it goes on
    store.set(NodeKeys.lost(1, 1), "0")  # an older incarnation's loss does not fence this one
    assert _rank(store.port, tmp_path, **node).stdout == "took part\n"
    store.set(NodeKeys.lost(1, 2), "0")
    fenced = _rank(store.port, tmp_path, **node)
    assert fenced.returncode == exitcodes.FENCED and "took part" not in fenced.stdout, fenced.stderr
    assert "node 1 was declared lost" in fenced.stderr and len(fenced.stderr.splitlines()) == 1, fenced.stderr
    assert store.check([NodeKeys.fenced(1, 2, 3)])  # its acknowledgement, for the agent taking the node over
    [event] = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (event["event"], event["rank"], event["node"], event["incarnation"], event["where"]) == (
        "fenced", 3, 1, 2, "join")
    assert _rank(store.port, tmp_path).stdout == "took part\n"  # one node (no incarnation given): no fence


CUT_OFF = """
import sys
from datetime import timedelta
import torch.distributed as dist
from resilient_train.rank.fence import leave_if_cut_off
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))
print("connected", flush=True)
sys.stdin.readline()  # the store's host is gone now
try:
    store.check(["k"])
except dist.DistNetworkError:
    leave_if_cut_off(store)
    print("stayed", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_rank_that_loses_the_store_leaves_fenced_unless_its_agent_hosts_it(tmp_path: Path) -> None:
    """Off node 0 a rank that lost the store cannot know whether its node was declared lost: it leaves as a
    fenced rank does (exit 94, no write, no collective), silently (its agent's line speaks for the node), and
    does not wait to acknowledge to a store that is gone. Node 0's ranks and a one-node job's stay: their
    agent hosts the store."""
    for node, expected in (({"RT_NODE": "1", "RT_NODE_INCARNATION": "1"}, exitcodes.FENCED),
                           ({"RT_NODE": "0", "RT_NODE_INCARNATION": "1"}, 0), ({}, 0)):
        server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())  # type: ignore[union-attr]
            rank = subprocess.Popen([sys.executable, "-c", CUT_OFF, str(port)], cwd=REPO, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={**os.environ, "RANK": "3", "RT_RUN_DIR": str(tmp_path), **node})
            assert rank.stdout.readline() == "connected\n"  # type: ignore[union-attr]
        finally:
            server.kill()
            server.wait()
        out, err = rank.communicate("go\n", timeout=60)
        assert rank.returncode == expected, (node, err)
        # Its own words: none (c10d's warning of the closed connection is the agent's to fold, nativelog).
        assert out == ("" if expected else "stayed\n") and "resilient-train" not in err, (node, out, err)
        assert "Traceback" not in err, err
    [event] = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (event["event"], event["rank"], event["node"], event["where"]) == ("fenced", 3, 1, "store lost")


@pytest.mark.timeout(60)
def test_a_fenced_agent_leaves_its_nodes_monitor_state_to_the_agent_that_took_the_node(tmp_path: Path) -> None:
    """The file is the node's, and the node is another agent's now: a fenced agent does not write it at its
    close (an agent that ends otherwise does)."""
    from jobs import GPT
    from resilient_train.agent import Agent, AgentConfig, AgentState

    for fenced in (False, True):
        run_dir = tmp_path / f"run-{fenced}"
        agent = Agent(AgentConfig(script=str(GPT), run_dir=str(run_dir)))
        agent.lifecycle.to(AgentState.RUNNING)
        if fenced:
            agent.ending.fence("lost the store on 127.0.0.1:1", restarts=0)
        agent.close()
        assert (run_dir / ".monitors" / "timeouts.json").exists() is not fenced
