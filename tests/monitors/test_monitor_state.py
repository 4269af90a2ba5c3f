"""The agent keeps the computed hang timeouts in RUN_DIR/.monitors/timeouts.json across jobs (real processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from monitors import HangConfig
from resilient_train.agent import Agent, AgentConfig
from jobs import GPT, Job, run_gpt


def _since_last_start(job: Job) -> list[dict]:
    """The events of the last job in the run directory (its monitor starts first, before the agent loads its state)."""
    ev = job.events()
    start = max(i for i, e in enumerate(ev) if e["event"] == "monitor_start")
    return ev[start:]


@pytest.mark.timeout(420)
def test_a_job_restarted_in_the_same_run_dir_keeps_its_computed_timeouts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    state_file = run_dir / ".monitors" / "timeouts.json"
    defaults = HangConfig()

    first = run_gpt(run_dir, nproc=2, steps=12)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = json.loads(state_file.read_text())["hang"]
    assert saved["version"] == 1
    # Every rank's every step, folded in before the exit, but the first of each generation (its sections are
    # no observations of their durations: monitors.progress).
    assert saved["observations"]["forward"] >= 2 * (12 - 1)
    computed = max(defaults.min_timeout, defaults.safety_factor * saved["observed_max_s"]["forward"])
    assert saved["timeouts_s"]["forward"] == pytest.approx(computed)
    assert saved["timeouts_s"]["forward"] < defaults.default_timeout
    assert not list(state_file.parent.glob("*.tmp"))  # written through a temporary file and renamed

    # A new job in the same run directory: rank 1 hangs in its second step, long before this job alone
    # could have seen min_observations forwards; the loaded timeout applies, not the 60 s default.
    second = run_gpt(run_dir, nproc=2, steps=4, faults=[{"kind": "hang", "rank": 1, "step": 1, "phase": "forward"}])
    assert second.returncode == 0, second.stderr[-3000:]
    ev = _since_last_start(second)
    loaded = [e for e in ev if e["event"] == "monitor_state_loaded"]
    assert len(loaded) == 1 and loaded[0]["timeouts_s"] == pytest.approx(saved["timeouts_s"])
    hang = next(e for e in ev if e["event"] == "hang_detected" and e["rank"] == 1)
    # The fault fires as the rank leaves "data" for "forward": the slot may still say "data".
    assert hang["section"] in ("data", "forward") and hang["step"] == 1
    assert saved["timeouts_s"][hang["section"]] < defaults.default_timeout
    assert hang["timeout_s"] >= saved["timeouts_s"][hang["section"]]  # maxima only grow when merged
    assert hang["timeout_s"] < defaults.default_timeout
    assert any(e["event"] == "recovery_done" for e in ev)

    after = json.loads(state_file.read_text())["hang"]
    assert after["observations"]["forward"] > saved["observations"]["forward"]  # the second job's forwards added
    assert after["observed_max_s"]["forward"] >= saved["observed_max_s"]["forward"]


@pytest.mark.timeout(60)
def test_an_unreadable_state_file_is_reported_and_replaced(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    state_file = run_dir / ".monitors" / "timeouts.json"
    state_file.parent.mkdir(parents=True)
    state_file.write_text("{not json")
    agent = Agent(AgentConfig(script=str(GPT), run_dir=str(run_dir)))
    agent.close()
    ev = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    ignored = [e for e in ev if e["event"] == "monitor_state_ignored"]
    assert len(ignored) == 1 and "timeouts.json" in ignored[0]["reason"]
    assert json.loads(state_file.read_text())["hang"]["version"] == 1  # close() wrote a valid state


@pytest.mark.timeout(420)
def test_computed_timeouts_travel_in_checkpoints_to_a_job_in_another_run_dir(tmp_path: Path) -> None:
    import shutil

    from checkpointing.catalog import list_steps
    from checkpointing.manifest import Manifest

    defaults = HangConfig()
    first = run_gpt(tmp_path / "a", nproc=2, steps=40, extra=["--ckpt-every", "20", "--ckpt-mode", "disabled"])
    assert first.returncode == 0, first.stderr[-3000:]
    newest = [s for s in list_steps(tmp_path / "a" / "checkpoints") if s.has_manifest][-1]
    assert newest.step == 40
    saved = Manifest.read(newest.path).extras["monitors"]["hang"]
    assert saved["timeouts_s"]["forward"] < defaults.default_timeout  # computed, not the default

    # The checkpoints move to a new run directory, without the agent's timeouts.json: the job resumes
    # from step 40, rank 0 hands the checkpoint's timeouts to the agent, and a hang at step 41 is
    # judged by them.
    run_b = tmp_path / "b"
    shutil.copytree(tmp_path / "a" / "checkpoints", run_b / "checkpoints")
    second = run_gpt(run_b, nproc=2, steps=44, extra=["--ckpt-every", "20", "--ckpt-mode", "disabled"],
                     faults=[{"kind": "hang", "rank": 1, "step": 41, "phase": "forward"}])
    assert second.returncode == 0, second.stderr[-3000:]
    loaded = second.of("monitor_state_loaded")
    assert [(e["source"], e["step"]) for e in loaded] == [("checkpoint", 40)], loaded
    assert loaded[0]["timeouts_s"]["forward"] == pytest.approx(saved["timeouts_s"]["forward"])
    hang = next(e for e in second.of("hang_detected") if e["rank"] == 1)
    assert hang["step"] == 41 and hang["timeout_s"] < defaults.default_timeout, hang
    assert not (run_b / ".monitors" / "timeouts-from-checkpoint.json").exists()  # taken by the agent


@pytest.mark.timeout(30)
def test_a_bad_monitor_state_file_never_reaches_a_checkpoint(tmp_path: Path) -> None:
    from monitors.persist import (
        monitor_state_path, offer_from_checkpoint, offered_state_path, read_monitor_state, take_offer,
    )

    assert read_monitor_state(tmp_path) is None  # none yet
    path = monitor_state_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert read_monitor_state(tmp_path) is None
    path.unlink()
    path.mkdir()  # unreadable as a file: an OSError, not a failed save
    assert read_monitor_state(tmp_path) is None
    path.rmdir()
    path.write_text(json.dumps({"hang": {"version": 1}}))
    assert read_monitor_state(tmp_path) == {"hang": {"version": 1}}
    written = offer_from_checkpoint(tmp_path, {"hang": {"version": 1}}, step=8)
    assert written == offered_state_path(tmp_path)
    assert json.loads(written.read_text()) == {"step": 8, "state": {"hang": {"version": 1}}}
    assert not list(written.parent.glob("*.tmp"))
    assert take_offer(tmp_path) == (8, {"hang": {"version": 1}}) and not written.exists()  # taken once
    assert take_offer(tmp_path) is None
    written.write_text("{not json")
    with pytest.raises(ValueError, match="timeouts-from-checkpoint.json"):
        take_offer(tmp_path)
    assert not written.exists()  # a bad offer is removed too
