"""Many nodes on one machine: one agent per node on 127.0.0.1, a spare node, node loss, preemption (issue 13)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import GPT, REPO, SMALL_GPT, Job, ckpt_diff, console_lines, free_port

STEPS = 24
NPROC = 2  # per node


class Cluster:
    """Agents of one job, each in its own session (a test can take a node down with everything on it)."""

    def __init__(self, run_dir: Path, *, nnodes: int, steps: int = STEPS, chaos: list[dict] | None = None,
                 node_timeout: float = 2.0, extra: list[str] | None = None, env: dict[str, str] | None = None,
                 agent_args: list[str] | None = None) -> None:
        self.run_dir, self.nnodes, self.steps = run_dir, nnodes, steps
        self.port = free_port()
        self.chaos = chaos
        self.node_timeout = node_timeout
        self.extra, self.env, self.agent_args = extra or [], env or {}, agent_args or []
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *, node_rank: int = 0, spare: bool = False) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "resilient_train.cli", "run", "--nnodes", str(self.nnodes),
               "--nproc-per-node", str(NPROC), "--master-addr", "127.0.0.1", "--master-port", str(self.port),
               "--rdzv-id", "test-job", "--run-dir", str(self.run_dir), "--node-timeout", str(self.node_timeout)]
        cmd += ["--spare"] if spare else ["--node-rank", str(node_rank)]
        if self.chaos:
            cmd += ["--chaos", json.dumps(self.chaos)]
        cmd += self.agent_args
        cmd += [str(GPT), "--steps", str(self.steps), *SMALL_GPT, *self.extra]
        p = subprocess.Popen(cmd, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, env={**os.environ, **self.env})
        self.agents[name] = p
        return p

    def wait(self, name: str, timeout: float = 150) -> Job:
        p = self.agents[name]
        out, err = p.communicate(timeout=timeout)
        return Job(p.returncode, out, err, self.run_dir)

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def wait_event(self, predicate, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if predicate(e):
                    return e
            for name, p in self.agents.items():
                assert p.poll() is None, f"agent {name} exited early ({p.returncode}): {p.communicate()[1][-3000:]}"
            time.sleep(0.05)
        raise AssertionError("timed out waiting for an event")

    def close(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def cluster_factory(tmp_path):
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(tmp_path / "run", **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.timeout(300)
def test_two_nodes_a_killed_rank_is_replaced_by_its_node_and_the_run_is_bitwise(cluster_factory, references):
    c = cluster_factory(nnodes=2, chaos=[{"kind": "kill", "rank": 3, "step": 8, "phase": "backward"}])
    c.start("node0", node_rank=0)
    c.start("node1", node_rank=1)
    jobs = {name: c.wait(name) for name in ("node0", "node1")}
    for name, job in jobs.items():
        assert job.returncode == 0, f"{name}: {job.stderr[-3000:]}"
    spawned = [e for e in c.events() if e["event"] == "worker_spawned" and e.get("replacement")]
    assert [(e["source"], e["rank"]) for e in spawned] == [("agent1", 3)]
    assert {e["rank"] for e in c.events() if e["event"] == "run_start"} == {0, 1, 2, 3}
    d = ckpt_diff(references.get(4, STEPS), c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_node_is_taken_over_by_the_spare_and_the_run_is_bitwise(cluster_factory, references):
    c = cluster_factory(nnodes=2, steps=40)
    c.start("node0", node_rank=0)
    c.start("node1", node_rank=1)
    c.start("spare", spare=True)
    c.wait_event(lambda e: e["event"] == "step_done" and e["step"] >= 6)
    # The spare node keeps a warm interpreter for each local rank it may take over (issue 22).
    c.wait_event(lambda e: e["event"] == "spare_ready" and e["source"] == "agent-spare" and e["ready"] == NPROC)
    os.killpg(c.agents["node1"].pid, signal.SIGKILL)  # the host dies: the agent and its ranks (PDEATHSIG)
    c.agents["node1"].wait()
    for name in ("node0", "spare"):
        job = c.wait(name, timeout=200)
        assert job.returncode == 0, f"{name}: {job.stderr[-3000:]}"
    lost = [e for e in c.events() if e["event"] == "node_lost"]
    assert [(e["node"], e["spare"]) for e in lost] == [(1, 0)]
    took = [e for e in c.events() if e["event"] == "node_started" and e["source"] == "agent-spare"]
    assert [(e["node"], e["returning"]) for e in took] == [(1, True)]
    spawned = [e for e in c.events() if e["event"] == "worker_spawned" and e["source"] == "agent-spare"]
    assert sorted((e["rank"], e["replacement"], e["warm"]) for e in spawned) == [(2, True, True), (3, True, True)]
    # The lost node's ranks heal (a survivor caught behind its peer's commit by the loss heals too).
    healed = [e for e in c.events() if e["event"] == "recovery_done" and e.get("healed")]
    assert healed and all(e["replacements"] == [2, 3] and {2, 3} <= set(e["healed"]) for e in healed), healed
    d = ckpt_diff(references.get(4, 40), c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_node_without_a_spare_comes_back_and_the_run_is_bitwise(cluster_factory, references):
    """No spare: the other node's ranks wait; the scheduler starts the node's agent again, whose fresh ranks
    heal from the live replicas (incarnation 2), world size kept, nothing redone from disk."""
    c = cluster_factory(nnodes=2, steps=40)
    c.start("node0", node_rank=0)
    c.start("node1", node_rank=1)
    c.wait_event(lambda e: e["event"] == "step_done" and e["step"] >= 6)
    os.killpg(c.agents["node1"].pid, signal.SIGKILL)
    c.agents["node1"].wait()
    del c.agents["node1"]  # wait_event asserts the others are alive
    lost = c.wait_event(lambda e: e["event"] == "node_lost")
    assert (lost["node"], lost["spare"]) == (1, None)
    c.start("node1-again", node_rank=1)
    for name in ("node0", "node1-again"):
        job = c.wait(name, timeout=200)
        assert job.returncode == 0, f"{name}: {job.stderr[-3000:]}"
    started = [(e["source"], e["incarnation"], e["returning"]) for e in c.events() if e["event"] == "node_started"
               and e["node"] == 1]
    assert started == [("agent1", 1, False), ("agent1", 2, True)], started
    healed = [e for e in c.events() if e["event"] == "recovery_done" and e.get("healed")]
    assert healed and all(e["replacements"] == [2, 3] and {2, 3} <= set(e["healed"]) and e["resume_from"] == "live"
                          for e in healed), healed
    d = ckpt_diff(references.get(4, 40), c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


def _live(pid: int) -> bool:
    """``pid`` runs (a zombie does not: its parent, a stopped agent, cannot reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


class RankCensus:
    """Counts, every 50 ms on a thread, the live processes of each rank (their pids from run_start events)."""

    def __init__(self, cluster: Cluster) -> None:
        import threading

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
                live = sorted(p for p in ps if _live(p))
                self.most = max(self.most, len(live))
                if len(live) > 1:
                    self.overlaps.append((rank, live))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.mark.timeout(300)
def test_a_stopped_agents_node_is_fenced_before_the_spare_replaces_it_and_every_agent_says_what_happened(
        cluster_factory, references, tmp_path):
    """Node 1's agent is SIGSTOPped while its ranks run on (issue 26 item 5): node 1 is declared lost, its ranks
    see their fence through the store and leave (exit 94) before the spare's replacements start, so no rank
    has two processes at any time; the job finishes bitwise; node 0 and the spare exit 0, and the stopped agent,
    woken after the job ended, exits 94 (fenced).

    Rank 2's main thread blocks at step 8 (its other threads run), so the job waits for the fence whatever the
    machine's speed: only the stopped agent would have killed it as hung, and node 0's agent must not kill its
    own ranks, which wait on rank 2, before the loss (a hang floor of 60 s)."""
    monitor = tmp_path / "monitor.json"
    monitor.write_text(json.dumps({"hang": {"idle_timeout_s": 60.0}, "metrics": {"prometheus": False}}))
    c = cluster_factory(nnodes=2, steps=40, node_timeout=2.0, agent_args=["--monitor-config", str(monitor)],
                        chaos=[{"kind": "block", "rank": 2, "step": 8, "phase": "forward"}])
    c.start("node0", node_rank=0)
    c.start("node1", node_rank=1)
    c.start("spare", spare=True)
    c.wait_event(lambda e: e["event"] == "spare_ready" and e["source"] == "agent-spare" and e["ready"] == NPROC)
    c.wait_event(lambda e: e["event"] == "step_done" and e["step"] >= 4)
    stale = {e["rank"]: e["pid"] for e in c.events() if e["event"] == "run_start" and e["rank"] in (2, 3)}
    census = RankCensus(c)
    try:
        os.kill(c.agents["node1"].pid, signal.SIGSTOP)  # only the agent: its ranks go on
        for name in ("node0", "spare"):
            job = c.wait(name, timeout=200)
            assert job.returncode == 0, f"{name}: {job.stderr[-3000:]}"
    finally:
        census.close()
        os.kill(c.agents["node1"].pid, signal.SIGCONT)
    woken = c.wait("node1", timeout=60)
    assert woken.returncode == 94, woken.stderr[-3000:]
    assert census.most == 1 and not census.overlaps, census.overlaps
    ev = c.events()
    [lost] = [e for e in ev if e["event"] == "node_lost"]
    assert (lost["node"], lost["incarnation"], lost["spare"]) == (1, 1, 0)
    fenced = {e["rank"]: e for e in ev if e["event"] == "fenced"}
    assert {r: e["pid"] for r, e in fenced.items()} == stale  # the stopped node's own ranks, and only they
    assert fenced[2]["where"] == "woken"  # its main thread was blocked: its watcher learned of the fence
    [acked] = [e for e in ev if e["event"] == "node_fenced"]
    assert (acked["source"], acked["left"], acked["missing"]) == ("agent-spare", [2, 3], [])
    spawned = [e for e in ev if e["event"] == "worker_spawned" and e["source"] == "agent-spare"]
    assert sorted(e["rank"] for e in spawned) == [2, 3]
    assert max(e["time"] for e in fenced.values()) <= acked["time"] <= min(e["time"] for e in spawned)
    assert not [e for e in ev if e["event"] == "fault_detected" and e["source"].startswith("agent")]  # none killed
    [end] = [e for e in ev if e["event"] == "agent_end" and e["source"] == "agent1"]
    assert (end["reason"], end["exit_code"]) == ("fenced", 94)
    d = ckpt_diff(references.get(4, 40), c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(200)
def test_a_stopped_node_0_ends_the_other_agents_by_their_store_deadline(cluster_factory):
    """Node 0's agent, which hosts the store, is SIGSTOPped: its connections stay open and silent, so c10d's
    client calls would block for ever. Node 1's agent ends by its calls' deadline (resilient_train.protocol.succession.
    movable: 5 s here); alone it is no majority of the two agents and node 0's port does not refuse (its host
    may live on), so it kills its ranks and exits 94 (fenced: it cannot know whether it was declared lost)
    with one line."""
    c = cluster_factory(nnodes=2, steps=400)
    c.start("node0", node_rank=0)
    c.start("node1", node_rank=1)
    c.wait_event(lambda e: e["event"] == "step_done" and e["step"] >= 4)
    ranks = [e["pid"] for e in c.events() if e["event"] == "run_start" and e["rank"] in (2, 3)]
    os.kill(c.agents["node0"].pid, signal.SIGSTOP)
    job = c.wait("node1", timeout=60)  # without the deadline it never ends
    assert job.returncode == 94, job.stderr[-3000:]
    said = [line for line in console_lines(job.stderr) if "lost the store on 127.0.0.1" in line]
    assert len(said) == 1 and "did not answer a check within" in said[0], job.stderr[-3000:]
    assert "no other agent of the job answers" in said[0] and "fenced out (exit code 94)" in said[0], said
    assert not [p for p in ranks if _live(p)]  # its ranks went with it


SLOW = "RESILIENT_TRAIN_CKPT_SLOW_WRITE"  # checkpointing.testhooks: the writer sleeps before a step's save
GRACE_S = 60  # the ranks' default preemption grace (resilient_train.protocol.shutdown.DEFAULT_GRACE_S)


@pytest.mark.timeout(600)
def test_sigterm_to_each_agent_in_turn_ends_every_node_in_75_on_time_and_the_run_is_bitwise(cluster_factory,
                                                                                              references):
    """2 nodes x 2 ranks, a checkpoint every 5 steps, each one's save slowed to 6 s in the writer while a
    SIGTERM arrives: first to node 1's agent, then (the same commands again) to node 0's, the store's host.
    Every rank stops at one boundary after the save in flight and the preemption's own; every agent exits 75
    within the grace plus 5 s, with one "preempted" line (the signalled agent tells the job it is leaving; node
    0 keeps the store until node 1 has left). A third start runs to the end, bitwise equal to a run with no
    preemption."""
    extra, old_kill = ["--ckpt-every", "5"], ["--shutdown-timeout", "3"]  # the old-style kill: ignored here
    stops: list[dict] = []
    for target, slow_step in (("node1", 5), ("node0", 10)):
        c = cluster_factory(nnodes=2, extra=extra, agent_args=old_kill, env={SLOW: f"6@{slow_step}"})
        started = time.time()  # the run directory's events of the start before (its preemption staged step 10 too)
        c.start("node0", node_rank=0)
        c.start("node1", node_rank=1)
        c.wait_event(lambda e: e["event"] == "checkpoint_staged" and e["step"] == slow_step and e["rank"] == 0
                     and e["time"] > started, timeout=200)
        signalled = time.monotonic()
        c.agents[target].send_signal(signal.SIGTERM)
        jobs = {name: c.wait(name, timeout=max(1.0, signalled + GRACE_S + 5 - time.monotonic()))
                for name in ("node0", "node1")}
        for name, job in jobs.items():
            assert job.returncode == 75, f"{name} (SIGTERM to {target}): {job.stderr[-3000:]}"
            said = [line for line in job.stderr.splitlines() if "preempted" in line]
            assert len(said) == 1 and "its checkpoint is committed" in said[0], (name, said)
        new = [e for e in c.events() if e["event"] == "preempted" and e not in stops]
        assert sorted(e["rank"] for e in new) == [0, 1, 2, 3] and all(e["checkpoint_committed"] for e in new), new
        (step,) = {e["step"] for e in new}
        assert step > slow_step and {e["in_flight"] for e in c.events() if e["event"] == "checkpoint_waiting"
                                     and e["step"] == step} == {slow_step}
        if stops:  # the second start resumed from the first one's checkpoint
            resumed = {e["step"] for e in c.events()
                       if e["event"] == "resumed_from_disk" and e["time"] > stops[0]["time"]}
            assert resumed == {stops[0]["step"]}, resumed
        stops += new
    c = cluster_factory(nnodes=2, extra=extra, agent_args=old_kill)
    c.start("node0", node_rank=0)
    c.start("node1", node_rank=1)
    for name in ("node0", "node1"):
        job = c.wait(name, timeout=200)
        assert job.returncode == 0, f"{name}: {job.stderr[-3000:]}"
    resumed = {e["step"] for e in c.events() if e["event"] == "resumed_from_disk" and e["time"] > stops[-1]["time"]}
    assert resumed == {stops[-1]["step"]}
    d = ckpt_diff(references.get(4, STEPS), c.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(30)
def test_slurm_environment_fills_the_node_flags():
    from resilient_train.agent.slurmenv import first_host, slurm_defaults

    env = {"SLURM_JOB_ID": "4711", "SLURM_NODEID": "2", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu[07-10],cpu1"}
    assert slurm_defaults(env) == {"node_rank": 2, "run_id": "slurm-4711", "nnodes": 4, "master_addr": "gpu07",
                                   "master_port": 29500 + 711}
    assert slurm_defaults({"SLURM_JOB_ID": "1"}) == {}  # not inside a step: no node of its own
    assert [first_host(x) for x in ("n1,n2", "a[3,5-6]", "solo")] == ["n1", "a3", "solo"]


def test_under_srun_a_spare_takes_no_node_rank_and_a_requeued_job_says_which_start_it_is(tmp_path, monkeypatch):
    """The Slurm template's spare nodes are the allocation's last (SLURM_NODEID past the job's nodes): a --spare
    agent takes no node rank from SLURM_NODEID. Each agent_start carries the job id and SLURM_RESTART_COUNT."""
    import argparse

    from resilient_train.launch import add_run_arguments, agent_fields
    from resilient_train.agent.slurmenv import slurm_defaults, slurm_job

    env = {"SLURM_JOB_ID": "4711", "SLURM_NODEID": "2", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "localhost,n2,n3"}
    assert slurm_defaults(env, spare=True) == {"run_id": "slurm-4711", "nnodes": 3, "master_addr": "localhost",
                                               "master_port": 29500 + 711}
    assert slurm_job(env) == {"slurm_job_id": "4711", "slurm_restart_count": 0}  # unset at the first start
    assert slurm_job({**env, "SLURM_RESTART_COUNT": "2"})["slurm_restart_count"] == 2
    assert slurm_job({}) == {}
    # What the template runs on its spare node: the flags win, SLURM_NODEID is not its node rank.
    p = argparse.ArgumentParser()
    add_run_arguments(p)
    args = p.parse_args(["--nnodes", "2", "--spare", "--run-dir", str(tmp_path), str(GPT)])
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # srun's environment, read by agent_fields
    fields = agent_fields(args, {"nnodes", "spare", "run_dir"}, {})
    assert (fields["nnodes"], fields["spare"], "node_rank" in fields) == (2, True, False)
    assert (fields["master_addr"], fields["master_port"]) == ("localhost", 29500 + 711)


@pytest.mark.timeout(120)
def test_under_srun_a_one_node_job_needs_no_flags(tmp_path):
    # srun's environment for a one-node job on this machine: the agent takes its port and node from it.
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).resolve().parent / "dropin" / "allreduce_loop.py"
    env = {**os.environ, "SLURM_JOB_ID": "4242", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "127.0.0.1"}
    p = subprocess.run([sys.executable, "-m", "resilient_train.cli", "run", "--nproc-per-node", "2",
                        "--run-dir", str(tmp_path / "run"), str(script), str(out), "1"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    assert {(out / f"rank{r}.attempt0").read_text().split()[2] for r in range(2)} == {str(29500 + 242)}
