"""Many-node jobs whose nodes have addresses of their own (issue 31 item 4): one network namespace per node on a
bridge (tests/cluster/netns.py), node 0's agent serving the store on its node's address, every other agent and
rank reaching it, and each other over gloo, across real interfaces. Faults on real links: a node killed whole,
and a node's link cut while its processes live."""

from __future__ import annotations

import time

import pytest

from cluster.netns import alive
from cluster.nsjob import NetCluster, RankCensus
from jobs import ckpt_diff, console_lines

STEPS = 40  # the fault-free reference of tests/runtime/test_trust.py too (one per session)
COLD = ["--no-spare"]  # a node that will lose no rank keeps no warm interpreter (each is a torch import at start)
# Rank 1's main thread blocks in step 12 (its other threads run; fired once per run: its replacement goes on),
# so that the job waits there for the test's fault, whatever the machine's speed.
BLOCK = [{"kind": "block", "rank": 1, "step": 12, "phase": "forward"}]


@pytest.mark.timeout(300)
def test_a_job_across_namespaces_runs_to_the_end_bitwise_equal_to_one_node(network, references, tmp_path):
    """2 nodes x 1 rank, each in its own namespace: the store is reached over the bridge and gloo's group forms
    across it (each node's host name resolves to loopback, so without the agent naming the interface, gloo
    offered its peers 127.0.0.1 and no generation ever formed); the final state equals a one-node run's."""
    net = network(2)
    c = NetCluster(net, tmp_path / "run", nnodes=2, steps=STEPS)
    c.start(net["node0"], node_rank=0, args=COLD)
    c.start(net["node1"], node_rank=1, args=COLD)
    jobs = {name: c.wait(name) for name in ("node0", "node1")}
    for name, job in jobs.items():
        assert job.returncode == 0, f"{name}: {job.stderr[-3000:]}"
        assert console_lines(job.stderr) == [], job.stderr[-3000:]  # not a warning: names resolve, links hold
    started = {e["source"]: e for e in c.events() if e["event"] == "node_started"}
    assert {(s, e["node"]) for s, e in started.items()} == {("agent0", 0), ("agent1", 1)}
    d = ckpt_diff(references.get(2, STEPS), c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_killed_whole_is_taken_over_by_the_spare_node_and_the_run_is_bitwise(network, references, tmp_path):
    """Node 1's host dies: every process in its namespace (its agent and its rank) SIGKILLed at once. Node 0's agent declares it lost after --node-timeout and hands it to the spare node, whose warm
    replacement heals from rank 0 over the bridge; the job finishes bitwise."""
    net = network(3)
    c = NetCluster(net, tmp_path / "run", nnodes=2, steps=STEPS, chaos=BLOCK)
    c.start(net["node0"], node_rank=0, args=COLD)
    c.start(net["node1"], node_rank=1, args=COLD)
    c.start(net["node2"], spare=True)
    c.wait_event(lambda e: e["event"] == "spare_ready" and e["source"] == "agent-spare")
    c.wait_event(lambda e: e["event"] == "fault_injected" and e["rank"] == 1)
    old = {e["rank"]: e["pid"] for e in c.events() if e["event"] == "run_start"}
    killed = net["node1"].kill()
    assert c.agents["node1"].pid in killed and old[1] in killed and not net["node1"].pids()
    for name in ("node0", "node2"):
        job = c.wait(name, timeout=200)
        assert job.returncode == 0, f"{name}: {job.stderr[-3000:]}"
    ev = c.events()
    assert [(e["node"], e["incarnation"], e["spare"]) for e in ev if e["event"] == "node_lost"] == [(1, 1, 0)]
    took = [e for e in ev if e["event"] == "node_started" and e["source"] == "agent-spare"]
    assert [(e["node"], e["returning"]) for e in took] == [(1, True)]
    [spawned] = [e for e in ev if e["event"] == "worker_spawned" and e["source"] == "agent-spare"]
    assert (spawned["rank"], spawned["replacement"], spawned["warm"]) == (1, True, True)
    healed = [e for e in ev if e["event"] == "recovery_done" and e.get("healed")]
    assert healed and all(e["replacements"] == [1] and 1 in e["healed"] for e in healed), healed
    d = ckpt_diff(references.get(2, STEPS), c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_cut_off_mid_run_is_fenced_the_spare_takes_it_and_its_link_restored_changes_nothing(
        network, references, tmp_path):
    """Node 1's link is cut (the bridge's end) while its agent and rank live, with nothing of it in flight:
    rank 1 blocked in step 12, its saves committed. Node 0's agent declares node 1 lost after --node-timeout
    (2 s) and hands it to the spare; node 1's agent, whose store calls now run past their deadline (5 s),
    cannot know whether it was declared lost, so it kills its rank and exits 94 in one line; the spare starts
    the replacement only after that (it waits for a node only cut off to fence itself), so rank 1 never has two
    processes. The cut node writes nothing more: no event of its rank, no checkpoint. The link
    comes back while its fenced agent still closes: nothing changes; the job finishes bitwise, node 0 and the
    spare exit 0."""
    net = network(3)
    # Saves every 4 steps, written by the rank itself (no writer process to start cold, 14 s here under load).
    c = NetCluster(net, tmp_path / "run", nnodes=2, steps=STEPS, chaos=BLOCK,
                   extra=["--ckpt-every", "4", "--ckpt-mode", "disabled"])
    c.start(net["node0"], node_rank=0, args=COLD)
    c.start(net["node1"], node_rank=1, args=COLD)
    c.start(net["node2"], spare=True)
    c.wait_event(lambda e: e["event"] == "spare_ready" and e["source"] == "agent-spare")
    c.wait_event(lambda e: e["event"] == "fault_injected" and e["rank"] == 1)
    # Its saves are written in step (no writer process): the last, step 12's, committed before the block.
    c.wait_event(lambda e: e["event"] == "checkpoint_committed" and e["rank"] == 1 and e["step"] == 12)
    old = {e["rank"]: e["pid"] for e in c.events() if e["event"] == "run_start"}
    census = RankCensus(c)
    try:
        cut_at = time.time()
        net["node1"].cut()
        end = c.wait_event(lambda e: e["event"] == "agent_end" and e["source"] == "agent1", timeout=60,
                           running=("node0", "node2"))
        assert not alive(old[1])  # killed by its own agent before it said so
        net["node1"].restore()
        cut = c.wait("node1", timeout=60)
        for name in ("node0", "node2"):
            job = c.wait(name, timeout=200)
            assert job.returncode == 0, f"{name}: {job.stderr[-3000:]}"
    finally:
        census.close()
    assert cut.returncode == 94, cut.stderr[-3000:]
    lines = console_lines(cut.stderr)
    assert len(lines) == 1 and f"lost the store on {net['node0'].address}:29500" in lines[0], lines
    assert "cannot know whether it was declared lost" in lines[0] and "exit code 94" in lines[0], lines
    assert (end["reason"], end["exit_code"], end["how"]) == ("fenced", 94, f"lost the store on "
                                                             f"{net['node0'].address}:29500")
    assert census.most == 1 and not census.overlaps, census.overlaps  # never two processes of rank 1
    ev = c.events()
    [lost] = [e for e in ev if e["event"] == "node_lost"]
    assert (lost["node"], lost["incarnation"], lost["spare"], lost["source"]) == (1, 1, 0, "agent0")
    [fenced] = [e for e in ev if e["event"] == "node_fenced"]
    assert (fenced["source"], fenced["left"], fenced["missing"]) == ("agent-spare", [], [1])  # it could not answer
    [new] = [e for e in ev if e["event"] == "run_start" and e["rank"] == 1 and e["pid"] != old[1]]
    # Nothing from the cut node after the cut but its agent's end: no event of its rank (a checkpoint, a fence
    # acknowledged), none of its agent's but that one, before its replacement started.
    after = [e for e in ev if cut_at < e["time"] < new["time"] and e["source"] in ("rank1", "agent1")]
    assert after == [end], after
    assert not [e for e in ev if e["event"] == "fenced"]  # the rank never ran again to find its fence
    # No file of the run's state was written from the cut until the replacement started (rank 0 waited for
    # rank 1 all along), and the cut node's rank was gone by then (the census): none is the cut node's.
    files = [f for d in ("checkpoints", "final") for f in (c.run_dir / d).rglob("*") if f.is_file()]
    assert files and not [f for f in files if cut_at < f.stat().st_mtime < new["time"]]
    d = ckpt_diff(references.get(2, STEPS), c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr
