"""Issue 32, elastic width: a lost node with no spare costs throughput, never the job, and never a bit.

Two nodes of two ranks on this machine, ``--nnodes 1:2``: the job's width is 4 logical ranks, computed by
however many processes live. Every test ends by comparing the final state with a fault-free run of 4 ranks
(the ordered average it uses too: ``--supervisor.ordered_reduction=true``) with ``ckpt diff``.
"""

from __future__ import annotations

import random

import pytest

from elastic_job import ElasticJob, step_at_least, width
from jobs import ckpt_diff, run_gpt

STEPS = 600
ORDERED = ["--supervisor.ordered_reduction=true"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_gpt(tmp_path_factory.mktemp("elastic-ref") / "run", nproc=4, steps=STEPS, agent_args=ORDERED, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    return job.run_dir / "final"


@pytest.fixture
def elastic(tmp_path):
    made: list[ElasticJob] = []

    def make(**kw) -> ElasticJob:
        job = ElasticJob(tmp_path / f"run{len(made)}", steps=STEPS, **kw)
        made.append(job)
        return job

    yield make
    for job in made:
        job.close()


@pytest.mark.timeout(420)
def test_a_node_lost_without_a_spare_shrinks_the_job_and_its_return_grows_it_back_bitwise(elastic, reference):
    job = elastic()
    job.start("node0", 0)
    job.start("node1", 1)
    kill_at = random.Random(32).randint(20, 80)
    job.wait_event(step_at_least(kill_at), running=("node0", "node1"))
    job.kill("node1")  # the host dies: its agent and ranks at once, no spare waits
    shrunk = job.wait_event(lambda e: e["event"] == "width_changed" and e["processes"] == 2)
    assert shrunk["logical"] == {"0": [0, 2], "1": [1, 3]}  # the survivors took node 1's logical ranks
    job.wait_event(step_at_least(kill_at + 40))  # it trains on, at the reduced width
    job.start("node1b", 1)  # the same command, started again
    job.wait_event(lambda e: e["event"] == "width_changed" and e["processes"] == 4 and e["generation"] > shrunk["generation"])
    first, second = job.wait("node0"), job.wait("node1b")
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    events = first.events()
    # No process started on node 0 after the loss: the survivors kept computing, in their own processes.
    spawned = [e for e in events if e["event"] == "worker_spawned" and e["rank"] in (0, 1)]
    assert len(spawned) == 2, spawned
    assert [e["processes"] for e in events if e["event"] == "width_changed"][-2:] == [2, 4]
    assert "node 1 lost and no spare: the job goes on with node(s) [0]" in first.stderr
    d = ckpt_diff(reference, job.run_dir / "final")
    assert d.returncode == 0, f"final state differs from the fault-free run: {d.stdout}{d.stderr}"


@pytest.mark.timeout(420)
def test_node_0_alone_first_and_node_1_joining_later_ends_as_both_from_the_start(elastic, reference):
    job = elastic()
    job.start("node0", 0)
    job.wait_event(step_at_least(10))  # node 0 alone: 2 processes computing 4 logical ranks
    job.start("node1", 1)
    first, second = job.wait("node0"), job.wait("node1")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], second.stderr[-2000:])
    changes = width(first.events())
    assert changes[0][2] == [0, 1] and changes[-1][2] == [0, 1, 2, 3], changes
    d = ckpt_diff(reference, job.run_dir / "final")
    assert d.returncode == 0, f"final state differs from the run on both nodes: {d.stdout}{d.stderr}"


@pytest.mark.timeout(420)
def test_a_node_killed_while_it_joins_leaves_the_job_on_node_0_bitwise(elastic, reference):
    job = elastic()
    job.start("node0", 0)
    job.wait_event(step_at_least(10))
    job.start("node1", 1)
    job.wait_event(lambda e: e["event"] == "width_request" and e["cause"] == "grow")
    job.kill("node1")  # while its ranks start and heal
    first = job.wait("node0")
    assert first.returncode == 0, first.stderr[-3000:]
    assert width(first.events())[-1][2] == [0, 1]
    d = ckpt_diff(reference, job.run_dir / "final")
    assert d.returncode == 0, f"final state differs from the fault-free run: {d.stdout}{d.stderr}"


@pytest.mark.timeout(420)
def test_below_min_nodes_every_agent_stops_with_75_and_the_same_command_resumes(elastic, tmp_path):
    job = elastic(nodes="2:3", nproc=1, extra=["--ckpt-every", "10"])
    job.start("node0", 0)
    job.start("node1", 1)
    job.wait_event(lambda e: e["event"] == "checkpoint_committed" and e["step"] >= 20, running=("node0", "node1"))
    job.kill("node1")
    first = job.wait("node0")
    assert first.returncode == 75, first.stderr[-3000:]
    said = [line for line in first.stderr.splitlines() if "fewer than --nnodes 2:3" in line]
    assert len(said) == 1 and "start the job again to resume from its newest checkpoint" in said[0], first.stderr
    # The same command on both nodes: it resumes from the newest checkpoint and finishes.
    job.start("node0b", 0)
    job.start("node1b", 1)
    again, other = job.wait("node0b"), job.wait("node1b")
    assert again.returncode == 0 and other.returncode == 0, (again.stderr[-2000:], other.stderr[-2000:])
    resumed = [e for e in again.events() if e["event"] == "resumed_from_disk"]
    assert resumed and resumed[-1]["step"] >= 20
