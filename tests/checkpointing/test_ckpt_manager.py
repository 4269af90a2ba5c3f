from __future__ import annotations

import os
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from checkpointing import CheckpointConfig, CheckpointManager, SavePhase, diff_states, write_state
from checkpointing.retention import select_deletions
from ckpt_helpers import make_state, rank_state
from monitors.events import EventLog, read_events

pytestmark = pytest.mark.timeout(120)


def test_select_deletions_keeps_last_and_every_nth() -> None:
    assert select_deletions([1, 2, 3, 4, 5, 6, 7], keep_last=2, keep_every=3) == [1, 2, 4, 5]
    assert select_deletions([5], keep_last=1, keep_every=0) == []
    assert select_deletions([], keep_last=1, keep_every=0) == []


def test_config_rejects_bad_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="in_flight must be one of"):
        CheckpointConfig(directory=tmp_path, in_flight="maybe")
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        CheckpointConfig(directory=tmp_path, keep_last=0)
    with pytest.raises(TypeError):
        CheckpointConfig(tmp_path)  # type: ignore[misc]  # keyword-only


def test_async_saves_load_newest_and_retention(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl", source="test")
    root = tmp_path / "ck"
    # A directory without a manifest never counts and is never deleted.
    (root / "step-100").mkdir(parents=True)
    config = CheckpointConfig(directory=root, keep_last=2, keep_every=3, local_keys=("rng",))
    with CheckpointManager(config, events=events) as mgr:
        writer_pids = set()
        mgr.prepare(rank_state(0, 0))  # buffers and writer ready before the first save
        for step in range(1, 8):
            live = rank_state(step, 0)
            h = mgr.save(step, live, extras={"step": step})
            # The live state may change as soon as save() returns: the buffers hold the copy.
            live["model"]["layer.weight"].add_(1.0)
            assert h.wait(60) == SavePhase.COMMITTED, h.error
            writer_pids.add(mgr.writer_pid)
        assert len(writer_pids) == 1  # one writer process, started by the first save, reused
        assert mgr.latest_step() == 7
    remaining = sorted(p.name for p in root.iterdir())
    assert remaining == ["latest", "step-100", "step-3", "step-6", "step-7"]
    assert (root / "latest").read_text().strip() == "step-7"
    with CheckpointManager(config, events=events) as mgr:
        state, manifest = mgr.load()
        assert manifest.step == 7 and manifest.extras == {"step": 7}
        assert diff_states(state, rank_state(7, 0)) is None
        template = rank_state(0, 0)
        filled, _ = mgr.load(template, step=6)
        assert filled["model"]["layer.weight"] is template["model"]["layer.weight"]
        assert diff_states(filled, rank_state(6, 0)) is None
    kinds = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds.count("checkpoint_committed") == 7 and "checkpoint_loaded" in kinds


def test_load_falls_back_past_corrupt_and_foreign_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    events = EventLog(tmp_path / "events.jsonl", source="test")
    config = CheckpointConfig(directory=root, keep_last=10, run_id="run-a")
    with CheckpointManager(config, events=events) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, make_state(step), blocking=True).phase == SavePhase.COMMITTED
    # step 3: a flipped byte; step 2: a complete checkpoint written by another run.
    shard = root / "step-3" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    write_state(root / "step-2", make_state(2), step=2, run_id="run-b")
    with CheckpointManager(config, events=events) as mgr:
        assert mgr.latest_step() == 3 and mgr.latest_step(verify=True) == 1
        state, manifest = mgr.load()
    assert manifest.step == 1 and diff_states(state, make_state(1)) is None
    invalid = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint_invalid"]
    # Each rejection is an event, once for latest_step(verify=True) and once for load().
    assert [(e["step"], e["file"]) for e in invalid] == [(3, "__0_0.distcp"), (2, "manifest.json")] * 2
    assert "checksum mismatch" in invalid[0]["reason"] and "run-b" in invalid[1]["reason"]


def test_in_flight_policy_skip_and_wait(tmp_path: Path) -> None:
    """Rank 0's save stays in flight until rank 1 (a second real manager) saves too."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))

    def client() -> dist.TCPStore:  # one connection per rank, as in a real job
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    events = EventLog(tmp_path / "events.jsonl", source="test")

    def config(policy: str) -> CheckpointConfig:
        return CheckpointConfig(directory=tmp_path / "ck", in_flight=policy, local_keys=("rng",), timeout_s=60)

    m0 = CheckpointManager(config("skip"), rank=0, world_size=2, store=client(), events=events)
    m1 = CheckpointManager(config("skip"), rank=1, world_size=2, store=client(), events=events)
    try:
        first = m0.save(1, rank_state(1, 0))
        skipped = m0.save(2, rank_state(2, 0))
        assert skipped.phase == SavePhase.SKIPPED and first.phase != SavePhase.COMMITTED
        assert m1.save(1, rank_state(1, 1)).wait(60) == SavePhase.COMMITTED
        assert first.wait(60) == SavePhase.COMMITTED
        m0.config.in_flight = m0.config.in_flight.WAIT
        second = m0.save(2, rank_state(2, 0))
        waiter_result: list[SavePhase] = []
        waiter = threading.Thread(target=lambda: waiter_result.append(m0.save(3, rank_state(3, 0)).phase), name="waiter")
        waiter.start()  # blocks in save(3) until save(2) is committed, which needs rank 1
        assert m1.save(2, rank_state(2, 1)).wait(60) == SavePhase.COMMITTED
        waiter.join(60)
        assert not waiter.is_alive() and second.phase == SavePhase.COMMITTED
        assert m1.save(3, rank_state(3, 1)).wait(60) == SavePhase.COMMITTED
        assert m0.wait(60) == SavePhase.COMMITTED
    finally:
        m0.close(60)
        m1.close(60)
    kinds = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert "checkpoint_skipped" in kinds and "checkpoint_waiting" in kinds


def test_killed_writer_fails_one_save_and_the_next_one_works(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    events = EventLog(tmp_path / "events.jsonl", source="test")
    with CheckpointManager(CheckpointConfig(directory=root), events=events) as mgr:
        assert mgr.save(1, make_state(1), blocking=True).phase == SavePhase.COMMITTED
        pid = mgr.writer_pid
        assert pid is not None
        os.kill(pid, 9)
        h = mgr.save(2, make_state(2), blocking=True)
        assert h.phase == SavePhase.FAILED and "died" in str(h.error)
        assert mgr.save(3, make_state(3), blocking=True).phase == SavePhase.COMMITTED
        assert mgr.writer_pid != pid
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1", "step-3"]
    failed = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [2]


def test_a_synchronous_save_streams_pieces_from_the_live_tensors_with_no_writer_process(tmp_path: Path) -> None:
    """async_mode="disabled": two real managers, each rank's share written a piece at a time from its own
    tensors (piece_mb far below the state, so several pieces per rank, numbered apart across ranks), no
    staging buffers and no writer process; the committed checkpoint loads back equal on both ranks."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))

    config = CheckpointConfig(directory=tmp_path / "ck", async_mode="disabled", local_keys=("rng",), timeout_s=60,
                              piece_mb=300 / 2**20)  # 300 bytes: a piece per tensor or two
    managers = [CheckpointManager(config, rank=r, world_size=2, store=client()) for r in range(2)]
    states = [rank_state(5, r, scale=4) for r in range(2)]
    phases: dict[int, SavePhase] = {}
    try:
        for m, state in zip(managers, states):
            m.prepare(state)  # nothing to allocate for a streamed save
        savers = [threading.Thread(target=lambda r=r: phases.update({r: managers[r].save(5, states[r]).phase}),
                                   name=f"save-{r}") for r in range(2)]
        for t in savers:
            t.start()
        for t in savers:
            t.join(60)
        assert phases == {0: SavePhase.COMMITTED, 1: SavePhase.COMMITTED}
        assert all(m.writer_pid is None for m in managers)  # no writer process was started
        assert all(not m._stager.buffers for m in managers)  # and no host copy of the state was staged
        step = tmp_path / "ck" / "step-5"
        writers = sorted(int(p.name.split("_")[2]) for p in step.glob("__*_0.distcp"))
        assert len(writers) > 2 and len(set(w % 2 for w in writers)) == 2, writers  # pieces of both ranks
        for r, m in enumerate(managers):
            loaded, manifest = m.load(rank_state(0, r, scale=4))
            assert manifest.step == 5 and diff_states(loaded, states[r]) is None
    finally:
        for m in managers:
            m.close(60)


@pytest.mark.timeout(120)
def test_a_save_from_a_thread_that_ends_keeps_its_writer(tmp_path: Path) -> None:
    """The writer dies with its rank (PR_SET_PDEATHSIG), which Linux ties to the thread that forked it. A save
    requested from a thread that then ends must keep the writer it started: it was SIGKILLed with the
    thread (a save already writing failed, "writer of rank 0 died (exit code -9)"; otherwise the committer
    started a second one, an interpreter's start later)."""
    with CheckpointManager(CheckpointConfig(directory=tmp_path / "ck")) as mgr:
        handles: list = []
        caller = threading.Thread(target=lambda: handles.append((mgr.save(1, make_state(1)), mgr.writer_pid)),
                                  name="short-lived")
        caller.start()
        caller.join(60)
        assert not caller.is_alive()
        handle, writer = handles[0]
        assert handle.wait(60) == SavePhase.COMMITTED, handle.error
        assert mgr.writer_pid == writer  # the same process wrote it
        state, manifest = mgr.load()
    assert manifest.step == 1 and diff_states(state, make_state(1)) is None
