"""SIGKILL at every stage of a multi-rank save; disk full; resharding 4 -> 2 and 3 ranks.

Each job is real processes (2 or more ranks, each with its writer process), a
real TCPStore and gloo group. A rank or writer kills itself at the named stage
of the save of step 2. When a rank died, the job is then killed (as a launcher
would), and the checkpoint directory is what a restart sees.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointing import CheckpointConfig, CheckpointManager, diff_states, read_state
from checkpointing.testhooks import KILL_AT_ENV
from ckpt_helpers import rank_state
from ckpt_job import start_job
from monitors.events import read_events


def _assert_newest_is(root: Path, step: int, world: int) -> None:
    """A restarted job (fresh managers, one per rank) resumes from ``step``, bitwise."""
    for rank in range(world):
        with CheckpointManager(CheckpointConfig(directory=root, local_keys=("rng",)), rank=rank, world_size=world, store=None if world == 1 else _NoStore()) as mgr:  # type: ignore[arg-type]
            state, manifest = mgr.load()
            assert manifest.step == step, (rank, manifest.step)
            assert diff_states(state, rank_state(step, rank)) is None


class _NoStore:
    """Loading never touches the store; a store is only required to save with world_size > 1."""


# (stage, the rank that dies, the step a restart resumes from, whether the restart also re-saves step 2)
RANK_STAGES = [
    ("staging", 0, 1, False),
    ("staged", 1, 1, False),
    ("reported", 0, 1, False),
    ("metadata", 0, 1, False),
    ("manifest", 0, 1, True),  # leaves a complete-looking step-2.tmp behind
    ("renamed", 0, 2, True),  # step-2 committed; saving it again replaces it
    ("latest", 0, 2, False),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("stage", "victim", "newest", "resave"), RANK_STAGES, ids=[s[0] for s in RANK_STAGES])
def test_rank_killed_at_stage(tmp_path: Path, stage: str, victim: int, newest: int, resave: bool) -> None:
    root = tmp_path / "ck"
    job = start_job(2, root, save="1,2", env={victim: {KILL_AT_ENV: f"{stage}@2@{victim}"}})
    rc = job.procs[victim].wait(timeout=200)
    assert rc == -9
    job.kill_all()  # the launcher tears the job down
    _assert_newest_is(root, newest, 2)
    assert not any(p.name == "step-2" for p in root.iterdir()) or newest == 2
    if not resave:
        return
    # The restarted job saves the same step again over whatever the crash left behind.
    job = start_job(2, root, save="2")
    for code, lines, err in job.wait(200):
        assert code == 0, err
        assert lines == [{"step": 2, "phase": "committed", "error": None}]
    _assert_newest_is(root, 2, 2)
    assert not (root / "step-2.tmp").exists()


WRITER_STAGES = [("writing", 1), ("written", 0)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("stage", "victim"), WRITER_STAGES, ids=[s[0] for s in WRITER_STAGES])
def test_writer_killed_at_stage_training_goes_on(tmp_path: Path, stage: str, victim: int) -> None:
    root = tmp_path / "ck"
    job = start_job(2, root, save="1,2,3", env={victim: {KILL_AT_ENV: f"{stage}@2@{victim}"}})
    results = job.wait(200)
    for code, lines, err in results:
        assert code == 0, err
        assert [(l["step"], l["phase"]) for l in lines] == [(1, "committed"), (2, "failed"), (3, "committed")]
    assert "died" in results[victim][1][1]["error"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1", "step-3"]
    _assert_newest_is(root, 3, 2)


@pytest.mark.timeout(240)
def test_disk_full_fails_cleanly_and_keeps_the_previous(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    # Step 1's shard (scale 1) fits under the limit; step 2's (scale 64) does not; step 3 fits again.
    job = start_job(1, root, save="1,2,3", extra=["--scales", "1,64,1", "--fsize-limit", "65536"])
    [(code, lines, err)] = job.wait(200)
    assert code == 0, err
    assert [(l["step"], l["phase"]) for l in lines] == [(1, "committed"), (2, "failed"), (3, "committed")]
    assert "writing the shard of rank 0 failed" in lines[1]["error"]  # torch's serializer hides EFBIG
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1", "step-3"]
    state, _ = read_state(root / "step-1", rank=0)
    assert diff_states(state, rank_state(1, 0)) is None
    failed = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 2 and "writing the shard" in failed[0]["reason"]


@pytest.mark.timeout(300)
def test_reshard_save_on_4_load_on_2_and_3(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    job = start_job(4, root, save="5")
    for code, lines, err in job.wait(240):
        assert code == 0, err
        assert lines == [{"step": 5, "phase": "committed", "error": None}]
    _, manifest = read_state(root / "step-5")
    assert manifest.world_size == 4 and sorted(manifest.local_trees) == [0, 1, 2, 3]
    for world, next_step in ((2, 6), (3, 6)):
        job = start_job(world, root, load=True, extra=[])
        results = job.wait(240)
        for rank, (code, lines, err) in enumerate(results):
            assert code == 0, err
            [line] = lines
            assert line["loaded"] == 5 and line["saved_world_size"] == 4 and line["diff"] is None
            assert line["has_rng"] and line["next_save"] == "committed"
        # The step-6 checkpoint written on the new world size, then removed for the next round.
        _, m6 = read_state(root / f"step-{next_step}")
        assert m6.world_size == world
        import shutil

        shutil.rmtree(root / f"step-{next_step}")
