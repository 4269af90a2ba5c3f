"""Issue 33 with real addresses: each node in a network namespace of its own (tests/cluster/netns.py), the store
served on node 0's address, every standby store on its own node's, and partitions made on the bridge.

Two sides of a partition never both go on: the side with a majority of the last generation's agents (or
exactly half, holding the store's host) moves the store or keeps it, the other is fenced (94) and writes
nothing. Each test ends bitwise equal to a fault-free run.
"""

from __future__ import annotations

import time

import pytest

from cluster.nsjob import NetCluster, RankCensus
from jobs import ckpt_diff, console_lines, run_gpt

STEPS = 40
COLD = ["--no-spare"]  # ranks that will not be replaced keep no warm interpreter (a torch import each)


def _quiet_after(events: list[dict], sources: set[str], since: float, until: float) -> list[dict]:
    """The events of ``sources`` between two times, their agents' ends aside."""
    return [e for e in events if e["source"] in sources and since < e["time"] < until and e["event"] != "agent_end"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_store_host_cut_off_is_fenced_and_the_majority_moves_the_store_on(network, references, tmp_path):
    """3 nodes x 1 rank and a spare node; node 0 (the store's host) is cut off from the three others by a
    partition. Its side is 1 of 4 agents: at its first claim it finds itself in the minority and is fenced
    with its rank; the other side opens node 1's standby store (3 of 4), hands node 0 to the spare, and the run
    ends bitwise. Nothing of node 0 reaches the run directory after the cut but its agent's end."""
    net = network(4)
    c = NetCluster(net, tmp_path / "run", nnodes=3, steps=STEPS)
    c.start(net["node0"], node_rank=0, args=COLD)
    c.start(net["node1"], node_rank=1, args=COLD)
    c.start(net["node2"], node_rank=2, args=COLD)
    c.start(net["node3"], spare=True)
    c.wait_event(lambda e: e["event"] == "spare_ready" and e["source"] == "agent-spare")
    c.wait_event(lambda e: e["event"] == "step_done" and e["step"] >= 8)
    old0 = [e["pid"] for e in c.events() if e["event"] == "run_start" and e["rank"] == 0]
    census = RankCensus(c)
    try:
        cut_at = time.time()
        net.partition(["node1", "node2", "node3"], ["node0"])
        cut = c.wait("node0", timeout=120)
        jobs = {name: c.wait(name, timeout=240) for name in ("node1", "node2", "node3")}
    finally:
        census.close()
    assert cut.returncode == 94, cut.stderr[-3000:]
    lines = console_lines(cut.stderr)
    assert len(lines) == 1 and "no majority" in lines[0] and "exit code 94" in lines[0], lines
    said = "\n".join(f"{name} ({job.returncode}): {console_lines(job.stderr)}" for name, job in jobs.items())
    assert all(job.returncode == 0 for job in jobs.values()), said
    events = c.events()
    moves = [e for e in events if e["event"] == "store_moved"]
    assert sorted(e["source"] for e in moves) == ["agent-spare", "agent1", "agent2"]
    assert {e["endpoint"].split(":")[0] for e in moves} == {net["node1"].address}  # node 1's own address
    [new] = [e for e in events if e["event"] == "run_start" and e["rank"] == 0 and e["pid"] not in old0]
    # Nothing from node 0 from the move on (a step completing as the cut came is before it).
    assert not _quiet_after(events, {"agent0", "rank0"}, min(e["time"] for e in moves), new["time"])
    assert census.most == 1 and not census.overlaps, census.overlaps  # never two live processes of rank 0
    d = ckpt_diff(references.get(3, STEPS), c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_two_two_split_goes_on_only_on_the_side_of_the_store_host(network, tmp_path_factory, tmp_path):
    """An elastic job of 4 nodes x 1 rank (--nnodes 2:4) split 2|2. Node 0's side is exactly half with the
    store's host: it declares nodes 2 and 3 lost and shrinks; the other half opens no store (no majority) and
    is fenced, both agents 94, writing nothing. The run ends equal to 4 ranks from the start."""
    ref = run_gpt(tmp_path_factory.mktemp("split-ref") / "run", nproc=4, steps=STEPS,
                  agent_args=["--supervisor.ordered_reduction=true"], timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    net = network(4)
    c = NetCluster(net, tmp_path / "run", nnodes="2:4", steps=STEPS,  # type: ignore[arg-type]
                   agent_args=["--rdzv-conf", "last_call_timeout=2"])
    for n in range(4):
        c.start(net[f"node{n}"], node_rank=n, args=COLD)
    c.wait_event(lambda e: e["event"] == "step_done" and e["step"] >= 8)
    cut_at = time.time()
    net.partition(["node0", "node1"], ["node2", "node3"])
    far = {name: c.wait(name, timeout=150) for name in ("node2", "node3")}
    near = {name: c.wait(name, timeout=240) for name in ("node0", "node1")}
    for name, job in far.items():
        assert job.returncode == 94, f"{name}: {job.stderr[-3000:]}"
    for name, job in near.items():
        assert job.returncode == 0, f"{name}: {job.stderr[-3000:]}"
    events = c.events()
    assert not [e for e in events if e["event"] == "store_moved"]  # the store stayed with node 0
    shrunk = [e for e in events if e["event"] == "width_changed" and e["processes"] == 2]
    assert shrunk and shrunk[-1]["members"] == [0, 1]
    ended = max(e["time"] for e in events if e["event"] == "agent_end" and e["source"] in ("agent2", "agent3"))
    assert not _quiet_after(events, {"agent2", "agent3", "rank2", "rank3"}, cut_at, ended)
    d = ckpt_diff(ref.run_dir / "final", c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr
