"""Issue 17, item 5: a save that lost a rank fails at once for the others and checkpointing goes on in the
next generation; required saves are never skipped; crashed saves' leftovers go at start; resume and
fallback are told on the console.

Real processes around one TCPStore, as under the agent: the test plays the agent (it declares a generation
failed by setting ``fault/{g}``, starts the replacement, and opens each generation's rendezvous). The save
timeout is an hour, far past the test's own timeout: only the cancellation can end the lost save in time.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from checkpointing import CheckpointConfig, CheckpointManager, SavePhase, diff_states, read_state
from checkpointing.testhooks import KILL_AT_ENV
from ckpt_helpers import make_state, rank_state
from monitors.events import EventLog, read_events

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
HOUR = 3600.0


class Rank:
    """A worker process whose JSON lines are read with a deadline."""

    def __init__(self, rank: int, port: int, root: Path, *, generation: int, plan: str, env: dict | None = None):
        e = dict(os.environ)
        e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
        e["OMP_NUM_THREADS"] = "1"
        e.pop(KILL_AT_ENV, None)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "cancel_worker.py"), "--rank", str(rank), "--world", "2", "--port", str(port),
             "--dir", str(root / "ck"), "--events", str(root / "events.jsonl"), "--generation", str(generation),
             "--plan", plan, "--timeout", str(HOUR)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e, bufsize=0)
        self._buf = b""
        self.lines: list[dict] = []

    def next_line(self, timeout: float = 90) -> dict:
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], timeout)
            chunk = os.read(fd, 65536) if ready else b""
            assert chunk, f"no line from the rank (exit {self.proc.poll()}): {self.proc.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        self.lines.append(json.loads(line))
        return self.lines[-1]

    def until_ready(self, generation: int) -> list[dict]:
        seen = []
        while (line := self.next_line()) != {"ready": generation}:
            seen.append(line)
        return seen

    def finish(self) -> int:
        out, err = self.proc.communicate(timeout=90)
        self.lines += [json.loads(x) for x in out.decode().splitlines() if x.strip()]
        assert self.proc.returncode == 0, err.decode()[-2000:]
        return self.proc.returncode


def _saves(lines: list[dict]) -> list[tuple[int, str, int]]:
    return [(x["step"], x["phase"], x["generation"]) for x in lines if "step" in x]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("victim", "stage"), [(1, "staged"), (0, "reported")], ids=["rank1-lost", "rank0-lost"])
def test_a_save_that_lost_a_rank_fails_at_once_and_the_next_generation_saves(
        tmp_path: Path, victim: int, stage: str) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ranks = [Rank(r, store.port, tmp_path, generation=0, plan="1,2,3",
                  env={KILL_AT_ENV: f"{stage}@2@{victim}"} if r == victim else None) for r in (0, 1)]
    survivor = ranks[1 - victim]
    try:
        for r in ranks:
            r.until_ready(0)
        store.set("gen/0/start", "1")
        assert ranks[victim].proc.wait(90) == -9  # killed itself mid-save of step 2
        store.set("fault/0", json.dumps({"rank": victim}))  # the agent declares generation 0 failed
        before = survivor.until_ready(1)
        assert [(x["step"], x["phase"]) for x in before] == [(1, "committed"), (2, "failed")]
        assert "cancelled" in before[1]["error"]
        # The replacement starts (a fresh manager: rank 0 removes what the crashed save left), then the
        # rendezvous of generation 1 opens and the survivor's next save goes through.
        replacement = Rank(victim, store.port, tmp_path, generation=1, plan="3")
        replacement.until_ready(1)
        store.set("gen/1/start", "1")
        survivor.finish()
        replacement.finish()
    finally:
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()
    assert _saves(survivor.lines)[-1] == (3, "committed", 1)
    assert _saves(replacement.lines) == [(3, "committed", 1)]
    root = tmp_path / "ck"
    assert (root / "latest").read_text().strip() == "step-3"
    state, _ = read_state(root / "step-3", rank=victim)
    assert diff_states(state, rank_state(3, victim)) is None
    events = list(read_events(tmp_path / "events.jsonl"))
    if victim == 0:
        removed = [e for e in events if e["event"] == "checkpoint_leftovers_removed"]
        assert removed and "step-2.tmp" in removed[-1]["directories"]
    assert not (root / "step-2.tmp").exists() or victim == 1  # with rank 0 alive, retention removes it later


@pytest.mark.timeout(120)
def test_a_required_save_waits_for_the_one_in_flight_instead_of_being_skipped(tmp_path: Path) -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30)) for _ in (0, 1)]
    config = CheckpointConfig(directory=tmp_path / "ck", in_flight="skip", local_keys=("rng",), timeout_s=60)
    m0, m1 = (CheckpointManager(config, rank=r, world_size=2, store=clients[r]) for r in (0, 1))
    try:
        first = m0.save(1, rank_state(1, 0))  # in flight until rank 1 saves step 1
        assert m0.save(2, rank_state(2, 0)).phase == SavePhase.SKIPPED
        result: list = []
        last = threading.Thread(target=lambda: result.append(m0.save(3, rank_state(3, 0), required=True)),
                                name="required-save")
        last.start()  # blocks until step 1 is committed, which needs rank 1
        assert m1.save(1, rank_state(1, 1)).wait(60) == SavePhase.COMMITTED
        last.join(60)
        assert not last.is_alive() and first.phase == SavePhase.COMMITTED
        assert m1.save(3, rank_state(3, 1), required=True).wait(60) == SavePhase.COMMITTED
        assert result[0].wait(60) == SavePhase.COMMITTED
    finally:
        m0.close(60)
        m1.close(60)


@pytest.mark.timeout(120)
def test_leftovers_are_removed_at_start_and_resume_and_fallback_are_told_on_stderr(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ck"
    config = CheckpointConfig(directory=root, keep_last=5)
    with CheckpointManager(config) as mgr:
        for step in (1, 2):
            assert mgr.save(step, make_state(step), blocking=True).phase == SavePhase.COMMITTED
    (root / "step-3.tmp").mkdir()  # a crashed save
    (root / "step-3.tmp" / "__0_0.distcp").write_bytes(b"half")
    os.rename(root / "step-1", root / "step-1.replaced")  # a crash between the two renames of a re-save
    shard = root / "step-2" / "__0_0.distcp"
    shard.write_bytes(b"x" + shard.read_bytes()[1:])  # corrupt the newest
    capfd.readouterr()
    events = EventLog(tmp_path / "events.jsonl", source="test")
    with CheckpointManager(config, events=events) as mgr:
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1", "step-2"]  # step-1 put back
        state, manifest = mgr.load()
    assert manifest.step == 1 and diff_states(state, make_state(1)) is None
    err = capfd.readouterr().err.splitlines()
    assert err == [
        "resilient-train: checkpoint step 2 is not valid (__0_0.distcp: checksum mismatch (corrupted)); "
        "falling back to an older one",
        f"resilient-train: resuming from checkpoint step 1 ({root / 'step-1'}, saved by 1 rank(s))",
    ]
    removed = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint_leftovers_removed"]
    assert removed[0]["directories"] == ["step-3.tmp"]


@pytest.mark.timeout(120)
def test_a_step_one_rank_skips_is_given_up_by_the_others_at_once(tmp_path: Path) -> None:
    """Rank 0 still has a save in flight and skips step 2; rank 1 (a replacement, nothing in flight) saves it.

    Rank 1 must not wait for a verdict that never comes: its save fails as soon as rank 0's skip is known,
    far inside the hour-long save timeout.
    """
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))

    events = EventLog(tmp_path / "events.jsonl", source="test")
    config = CheckpointConfig(directory=tmp_path / "ck", in_flight="skip", local_keys=("rng",), timeout_s=HOUR)
    m0 = CheckpointManager(config, rank=0, world_size=2, store=client(), events=events)
    m1 = CheckpointManager(config, rank=1, world_size=2, store=client(), events=events)
    try:
        first = m0.save(1, rank_state(1, 0))  # never joined by rank 1: stays in flight
        assert m0.save(2, rank_state(2, 0)).phase == SavePhase.SKIPPED
        lone = m1.save(2, rank_state(2, 1))
        assert lone.wait(60) == SavePhase.FAILED
        failed = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint_failed"]
        assert any("rank 0 skipped the step" in e.get("reason", "") for e in failed), failed
        assert first.phase != SavePhase.COMMITTED
        # Checkpointing goes on: rank 1 joins step 1 late, and it commits.
        assert m1.save(1, rank_state(1, 1)).wait(60) == SavePhase.COMMITTED
        assert first.wait(60) == SavePhase.COMMITTED
    finally:
        m1.close(5)
        m0.close(5)


def _two_managers(tmp_path: Path, events: EventLog) -> tuple[dist.TCPStore, CheckpointManager, CheckpointManager]:
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    config = CheckpointConfig(directory=tmp_path / "ck", in_flight="skip", local_keys=("rng",), timeout_s=60)
    m0, m1 = (CheckpointManager(config, rank=r, world_size=2, events=events,
                                store=dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                    timeout=timedelta(seconds=30))) for r in (0, 1))
    return server, m0, m1


def _both(save0, save1) -> list:
    """Both ranks' calls at once (each may wait for the other's part of the save)."""
    out: list = [None, None]
    threads = [threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f()), name=f"rank{i}")
               for i, f in enumerate((save0, save1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.timeout(120)
def test_a_required_save_of_the_step_just_saved_is_that_save_not_a_second_write(tmp_path: Path) -> None:
    """A preemption stops the job at a step whose periodic save is in flight. The preemption's save of that
    step waits for it and is it: one commit per rank, not a second save under the first one's store keys
    (which reported rank 1 committed before rank 0 had the second save's files, and failed rank 0's commit:
    the ranks disagreed on whether the preemption's checkpoint committed)."""
    events = EventLog(tmp_path / "events.jsonl", source="test")
    _, m0, m1 = _two_managers(tmp_path, events)
    try:
        periodic = _both(lambda: m0.save(5, rank_state(5, 0)), lambda: m1.save(5, rank_state(5, 1)))
        again = _both(lambda: m0.save(5, rank_state(5, 0), required=True, wait_s=60, tag="preemption"),
                      lambda: m1.save(5, rank_state(5, 1), required=True, wait_s=60, tag="preemption"))
        assert again[0] is periodic[0] and again[1] is periodic[1]
        assert [h.wait(60) for h in again] == [SavePhase.COMMITTED, SavePhase.COMMITTED]
        committed = [(e["rank"], e["step"]) for e in read_events(tmp_path / "events.jsonl")
                     if e["event"] == "checkpoint_committed"]
        assert sorted(committed) == [(0, 5), (1, 5)]
        state, _ = m1.load()
        assert diff_states(state, rank_state(5, 1)) is None
    finally:
        m0.close(10)
        m1.close(10)


@pytest.mark.timeout(120)
def test_a_step_whose_first_save_was_skipped_is_saved_again_under_its_own_keys(tmp_path: Path) -> None:
    """Rank 0 skips step 2 (step 1 still in flight) while rank 1 saves it, which fails at once; then both
    save step 2 again (a preemption's: required, tagged). The second save must not read the first's keys
    (rank 0's skip marker, rank 1's report of the first save): both ranks commit it, with their state."""
    events = EventLog(tmp_path / "events.jsonl", source="test")
    _, m0, m1 = _two_managers(tmp_path, events)
    try:
        first = m0.save(1, rank_state(1, 0))  # in flight until rank 1 saves step 1
        assert m0.save(2, rank_state(2, 0)).phase == SavePhase.SKIPPED
        assert m1.save(2, rank_state(2, 1)).wait(60) == SavePhase.FAILED
        assert m1.save(1, rank_state(1, 1)).wait(60) == SavePhase.COMMITTED and first.wait(60) == SavePhase.COMMITTED
        again = _both(lambda: m0.save(2, rank_state(2, 0), required=True, wait_s=60, tag="preemption"),
                      lambda: m1.save(2, rank_state(2, 1), required=True, wait_s=60, tag="preemption"))
        assert [h.wait(60) for h in again] == [SavePhase.COMMITTED, SavePhase.COMMITTED]
        for m, r in ((m0, 0), (m1, 1)):
            state, manifest = m.load()
            assert manifest.step == 2 and diff_states(state, rank_state(2, r)) is None
    finally:
        m0.close(10)
        m1.close(10)
