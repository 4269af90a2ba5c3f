"""examples/slurm/train.sbatch under a real Slurm (tests/cluster/slurmcluster.py): the very file, run on CPU.

sbatch's command-line options override the template's GPU sizes (``--gpus-per-node=0 --cpus-per-task=1``),
``RT_NPROC_PER_NODE=1`` gives one rank a node, and the arguments after the file are the agent's flags and the
training command. The signals are Slurm's own (``scancel -s USR1``: what ``--signal=USR1@N`` sends to every
process of the job's steps; ``scancel -b -s USR1``: what ``--signal=B:USR1@N`` sends to the batch script), and
the job's state is Slurm's (``scontrol show job``: JobState, Restarts, ExitCode).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jobs import GPT, REPO, SMALL_GPT, ckpt_diff, events_now, free_port
from slurmcluster import SlurmCluster

TEMPLATE = REPO / "examples" / "slurm" / "train.sbatch"
CPU = ["--gpus-per-node=0", "--cpus-per-task=1"]  # the template asks for 8 GPUs and 16 CPUs a node
BUG_SCRIPT = REPO / "tests" / "runtime" / "misuse_script.py"  # "keyerror": every step from 3 raises, a bug
STEPS = 80
# Rank 0's steps take 50 ms more from the first one of each start: a signal sent after step 5 finds the job
# seconds from its end. The numbers are those of a run without it.
SLOWED = [{"kind": "slow", "rank": 0, "phase": "forward", "duration_s": 3600}]
REQUEUE, BUG = 75, 93


@dataclass
class TemplateJob:
    cluster: SlurmCluster
    id: str
    run_dir: Path
    log: Path

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return [e for e in events_now(self.run_dir) if name is None or e["event"] == name]

    def wait_event(self, predicate: Any, *, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for e in events_now(self.run_dir):
                if predicate(e):
                    return e
            state = self.cluster.job(self.id).get("JobState")
            assert state in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"), f"job {self.id} is {state}: {self.tail()}"
            assert time.monotonic() < deadline, f"job {self.id}: no such event in {timeout} s: {self.tail()}"
            time.sleep(0.1)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no output yet)"


def submit(slurm: SlurmCluster, tmp_path: Path, *, nodes: int, script: list[str], spare_nodes: int = 0,
           chaos: list[dict] | None = None, options: list[str] | None = None) -> TemplateJob:
    run_dir = tmp_path / "run"
    # The job's environment is this one (sbatch passes it on): PYTHONPATH, and this interpreter's
    # resilient-train first on PATH. Another session's test cluster numbers its jobs from 1 too: the store's
    # default port (29500 + the id's last three digits) would be the same, so the port is a free one.
    env = {"RUN_DIR": str(run_dir), "RT_NPROC_PER_NODE": "1", "RT_SPARE_NODES": str(spare_nodes),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    agent = ["--master-port", str(free_port()), "--node-timeout", "3"]
    if chaos:
        agent += ["--chaos", json.dumps(chaos)]
    job = slurm.sbatch(TEMPLATE, *agent, *script, env=env, cwd=tmp_path,
                       options=[f"--nodes={nodes}", *CPU, f"--output={tmp_path}/slurm-%j.log", *(options or [])])
    return TemplateJob(slurm, job, run_dir, tmp_path / f"slurm-{job}.log")


def gpt(steps: int = STEPS) -> list[str]:
    return [str(GPT), "--steps", str(steps), *SMALL_GPT]


def starts(job: TemplateJob) -> list[int]:
    """SLURM_RESTART_COUNT of each agent_start of node 0's agent, in order."""
    return [e["slurm_restart_count"] for e in job.events("agent_start") if e["source"] == "agent0"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_template_preempted_by_either_signal_requeues_itself_resumes_and_completes_bitwise(
        slurm, tmp_path, references):
    """Preempted twice: first the --signal=B:USR1 way (to the batch script, which forwards it through srun),
    then the --signal=USR1 way (to every process of the step). Each time every agent exits 75 after a
    committed checkpoint, the script requeues the job, and its next start resumes at the step it stopped at.
    The job ends COMPLETED after 2 restarts, its state bitwise that of an undisturbed run."""
    job = submit(slurm, tmp_path, nodes=2, script=gpt(), chaos=SLOWED)
    stops: list[int] = []
    for restarts, signal_options in ((0, ["-b", "-s", "USR1"]), (1, ["-s", "USR1"])):
        after = stops[-1] if stops else 0
        job.wait_event(lambda e: e["event"] == "step_done" and e["step"] >= after + 5
                       and starts(job)[-1:] == [restarts], timeout=150)
        slurm.scancel(job.id, *signal_options)
        fields = slurm.wait_job(job.id, lambda f: int(f["Restarts"]) == restarts + 1, timeout=120,
                                what=f"requeue {restarts + 1}")
        ends = [e for e in job.events("agent_end") if e.get("exit_code") == REQUEUE]
        assert len(ends) == 2 * (restarts + 1), ends  # both agents, each time
        preempted = job.events("preempted")[-2:]
        assert {e["rank"] for e in preempted} == {0, 1} and all(e["checkpoint_committed"] for e in preempted)
        assert len({e["step"] for e in preempted}) == 1, preempted
        stops.append(preempted[0]["step"])
        assert fields["JobState"] in ("PENDING", "REQUEUED", "RUNNING", "COMPLETING"), fields
    fields = slurm.wait_ended(job.id, timeout=180)
    assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", "2", "0:0"), job.tail()
    # Every start of every node's agent says which it was; each start after a requeue resumed where the one
    # before stopped: no step lost, none done twice.
    assert sorted(e["slurm_restart_count"] for e in job.events("agent_start")) == [0, 0, 1, 1, 2, 2]
    assert {e["slurm_job_id"] for e in job.events("agent_start")} == {job.id}
    resumed = job.events("resumed_from_disk")
    assert [e["step"] for e in resumed] == [stops[0], stops[0], stops[1], stops[1]], resumed
    assert stops[0] < stops[1] < STEPS
    log = job.tail()
    assert "rt: SIGUSR1: forwarded to the agents" in log and log.count("requeueing job") == 2
    d = ckpt_diff(references.get(2, STEPS), job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(240)
def test_a_cancelled_job_is_not_requeued_although_its_agents_exit_75(slurm, tmp_path):
    """scancel sends SIGTERM to the job's every process, the batch script's too: the agents take it as a
    preemption and exit 75 with a committed checkpoint, but the script died with the job (and a requeue of a
    cancelled job is refused by the script): the job stays CANCELLED."""
    job = submit(slurm, tmp_path, nodes=2, script=gpt(), chaos=SLOWED)
    job.wait_event(lambda e: e["event"] == "step_done" and e["step"] >= 3, timeout=150)
    slurm.scancel(job.id)
    slurm.wait_ended(job.id, timeout=60)
    slurm.wait_job_gone(job.id, timeout=60)  # nothing of the job is left that could requeue it
    fields = slurm.job(job.id)
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), fields
    ends = job.events("agent_end")
    assert sorted(e["exit_code"] for e in ends) == [REQUEUE, REQUEUE] and all(e["checkpoint_committed"] for e in ends)
    assert "requeueing" not in job.tail()


@pytest.mark.timeout(240)
def test_a_job_stopped_as_a_bug_is_not_requeued(slurm, tmp_path):
    """Every step from 3 raises KeyError: the replay raises again, every agent exits 93; the script does not
    requeue and switches Slurm's own requeue off for the job: FAILED with 93, never restarted."""
    job = submit(slurm, tmp_path, nodes=2, script=[str(BUG_SCRIPT), "keyerror"])
    fields = slurm.wait_ended(job.id, timeout=180)
    slurm.wait_job_gone(job.id, timeout=60)
    fields = slurm.job(job.id)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "93:0", "0"), job.tail()
    assert fields["Requeue"] == "0", fields
    assert sorted(e["exit_code"] for e in job.events("agent_end")) == [BUG, BUG]
    assert "stopped the job as a bug (exit 93): not requeued" in job.tail()


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("lost", ["host", "processes"])
def test_a_lost_node_is_taken_over_by_the_spare_node_and_the_job_completes(slurm, tmp_path, references, lost):
    """3 nodes, the last a spare (RT_SPARE_NODES=1), --no-kill. Node 1 is lost mid-run: its host dies (its
    slurmd, slurmstepd, task shell, agent and rank SIGKILLed at once), or only the job's processes on it die
    (slurmd lives: Slurm keeps the node, and srun reports the task killed, 137). The spare takes over node 1's
    rank and the job finishes bitwise; Slurm keeps the job (--no-kill; a dead host is declared down), which
    ends COMPLETED: the template takes node 0's agent's code, not srun's."""
    job = submit(slurm, tmp_path, nodes=3, spare_nodes=1, script=gpt(), chaos=SLOWED, options=["--no-kill"])
    node1 = slurm.nodes[1]  # the job holds all three nodes: node i of the job is the cluster's node i
    job.wait_event(lambda e: e["event"] == "spare_ready" and e["source"] == "agent-spare", timeout=150)
    job.wait_event(lambda e: e["event"] == "step_done" and e["step"] >= 5, timeout=150)
    try:
        killed = slurm.kill_node(node1, daemons=lost == "host")
        # The task's shell, the agent, its rank, its warm spare; the host: slurmd and slurmstepd too.
        assert len(killed) >= (6 if lost == "host" else 4), killed
        fields = slurm.wait_ended(job.id, timeout=240)
    finally:
        slurm.wait_job_gone(job.id, timeout=120)
        if lost == "host":
            slurm.start_node(node1)  # back for the next test (ReturnToService=2)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), job.tail()
    lost_events = job.events("node_lost")
    assert [(e["node"], e["spare"]) for e in lost_events] == [(1, 0)], lost_events
    assert {(e["source"], e["ok"]) for e in job.events("agent_end")} == {("agent0", True), ("agent-spare", True)}
    if lost == "processes":
        assert "rt: srun exited 137, node 0's agent 0: the job's code is 0" in job.tail()
    d = ckpt_diff(references.get(2, STEPS), job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr
