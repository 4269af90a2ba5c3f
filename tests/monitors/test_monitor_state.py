"""The agent keeps the computed hang timeouts in RUN_DIR/.monitors/timeouts.json across jobs (real processes)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from monitors import HangConfig, MonitorConfig, NodeMonitor
from monitors.sections import SECTIONS
from resilient_train.agent import Agent, AgentConfig
from jobs import GPT, Job, run_gpt
from oneline import BAD_NUMBERS

CKPT = ["--ckpt-every", "20", "--ckpt-mode", "disabled"]


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
    # Every rank's every step, folded in before the exit (first steps of a generation too: monitors.progress).
    assert saved["observations"]["forward"] >= 2 * 12
    computed = max(defaults.idle_timeout_s, defaults.safety_factor * saved["observed_max_s"]["forward"])
    assert saved["timeouts_s"]["forward"] == pytest.approx(computed)
    assert not list(state_file.parent.glob("*.tmp"))  # written through a temporary file and renamed

    # A new job in the same run directory starts from the saved observations: a timeout it learned never
    # shrinks (maxima merge by max). Rank 1 stops (SIGSTOP) in its second step: found stopped and replaced.
    second = run_gpt(run_dir, nproc=2, steps=4, faults=[{"kind": "hang", "rank": 1, "step": 1, "phase": "forward"}])
    assert second.returncode == 0, second.stderr[-3000:]
    ev = _since_last_start(second)
    loaded = [e for e in ev if e["event"] == "monitor_state_loaded"]
    assert len(loaded) == 1 and loaded[0]["timeouts_s"] == pytest.approx(saved["timeouts_s"])
    hang = next(e for e in ev if e["event"] == "hang_detected" and e["rank"] == 1)
    # The fault fires as the rank leaves "data" for "forward": the slot may still say "data".
    assert hang["section"] in ("data", "forward") and hang["step"] == 1 and hang["evidence"] == "stopped"
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


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory whose newest checkpoint (step 40) carries the computed timeouts.

    Two jobs in one run directory: the first (20 steps) ends with the computed timeouts saved in the run
    directory (the agent writes its state as it closes); the second resumes from step 20 and starts from
    that state, so rank 0's checkpoint at step 40 carries computed timeouts whatever the timing. (One 40-step
    job is not enough: the agent saves a changed timeout at most every 0.5 s, and a fast job can write its
    step-40 checkpoint before the agent's file holds any computed one.)
    """
    run = tmp_path_factory.mktemp("checkpointed") / "a"
    first = run_gpt(run, nproc=2, steps=20, extra=CKPT)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = json.loads((run / ".monitors" / "timeouts.json").read_text())["hang"]
    assert saved["observations"]["forward"] >= 2 * 20  # computed: min_observations seen
    second = run_gpt(run, nproc=2, steps=40, extra=CKPT)
    assert second.returncode == 0, second.stderr[-3000:]
    return run / "checkpoints"


def _newest(checkpoints: Path) -> Path:
    from checkpointing.catalog import list_steps

    newest = [s for s in list_steps(checkpoints) if s.has_manifest][-1]
    assert newest.step == 40
    return newest.path


@pytest.mark.timeout(420)
def test_computed_timeouts_travel_in_checkpoints_to_a_job_in_another_run_dir(tmp_path: Path, checkpointed: Path) -> None:
    from checkpointing.manifest import Manifest

    defaults = HangConfig()
    saved = Manifest.read(_newest(checkpointed)).extras["monitors"]["hang"]
    assert saved["observations"]["forward"] >= defaults.min_observations  # computed, not the default
    assert saved["timeouts_s"]["forward"] == pytest.approx(
        max(defaults.idle_timeout_s, defaults.safety_factor * saved["observed_max_s"]["forward"]))

    # The checkpoints move to a new run directory, without the agent's timeouts.json: the job resumes
    # from step 40, rank 0 hands the checkpoint's timeouts to the agent, and a hang at step 41 is
    # judged by them.
    run_b = tmp_path / "b"
    shutil.copytree(checkpointed, run_b / "checkpoints")
    second = run_gpt(run_b, nproc=2, steps=44, extra=CKPT,
                     faults=[{"kind": "hang", "rank": 1, "step": 41, "phase": "forward"}])
    assert second.returncode == 0, second.stderr[-3000:]
    loaded = second.of("monitor_state_loaded")
    assert [(e["source"], e["step"]) for e in loaded] == [("checkpoint", 40)], loaded
    assert loaded[0]["timeouts_s"]["forward"] == pytest.approx(saved["timeouts_s"]["forward"])
    hang = next(e for e in second.of("hang_detected") if e["rank"] == 1)
    assert hang["step"] == 41 and hang["evidence"] == "stopped", hang
    after = json.loads((run_b / ".monitors" / "timeouts.json").read_text())["hang"]
    assert after["observed_max_s"]["forward"] >= saved["observed_max_s"]["forward"]  # merged: never shrinks
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


@pytest.mark.timeout(300)
def test_a_checkpoint_forged_to_switch_hang_detection_off_is_refused(tmp_path: Path, checkpointed: Path) -> None:
    """Issue 26: every saved time 1e308 in the manifest's extras, its self checksum recomputed. The agent
    refuses the state in one line, and a deadlocked rank (idle) is still killed, by the configured timeout."""
    from checkpointing.manifest import MANIFEST_FILE, _canonical_digest

    run = tmp_path / "c"
    shutil.copytree(checkpointed, run / "checkpoints")
    manifest = _newest(run / "checkpoints") / MANIFEST_FILE
    body = json.loads(manifest.read_text())
    hang = body["extras"]["monitors"]["hang"]
    for part in ("observed_max_s", "timeouts_s"):
        hang[part] = {s: 1e308 for s in SECTIONS}
    del body["self_checksum"]
    body["self_checksum"] = _canonical_digest(body)
    manifest.write_text(json.dumps(body))
    cfg = tmp_path / "monitor.json"
    cfg.write_text(json.dumps({"hang": {"idle_timeout_s": 5.0}}))
    job = run_gpt(run, nproc=2, steps=42, extra=CKPT, agent_args=["--monitor-config", str(cfg)],
                  faults=[{"kind": "deadlock", "rank": 1, "step": 41, "phase": "forward"}])
    assert job.returncode == 0, job.stderr[-3000:]
    assert not job.of("monitor_state_loaded")
    [ignored] = job.of("monitor_state_ignored")
    from monitors.hang import OBSERVED_SLACK
    from monitors.hangconfig import HangConfig
    high = OBSERVED_SLACK * HangConfig(idle_timeout_s=5.0).longest_timeout_s  # the busy floor's, 30 min: 3600
    assert f"must be in [0, {high:g}], got 1e+308" in ignored["reason"], ignored
    said = [line for line in job.stderr.splitlines() if "hang timeouts are ignored" in line]
    assert len(said) == 1 and "observed_max_s" in said[0], job.stderr[-3000:]
    hang_seen = next(e for e in job.of("hang_detected") if e["rank"] == 1)
    # An idle rank (a deadlock) is judged by the idle timeout, which the forged state would have switched off.
    assert (hang_seen["step"], hang_seen["evidence"], hang_seen["timeout_s"]) == (41, "idle", 5.0), hang_seen
    assert any(e["event"] == "recovery_done" for e in job.events())


def _full_state() -> dict:
    """A saved state that names every section, as the agent writes it once each was seen."""
    return {"hang": {"version": 1, "observed_max_s": {s: 0.5 for s in SECTIONS},
                     "observations": {s: 20 for s in SECTIONS}, "timeouts_s": {s: 3.0 for s in SECTIONS}}}


def _number_paths(node: object, path: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _number_paths(v, (*path, k))]
    return [path] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


@pytest.mark.timeout(60)
def test_every_number_of_a_saved_monitor_state_is_range_checked(tmp_path: Path) -> None:
    """Issue 26: 1e308, inf, nan, -1 and 2**70 in each number of a saved state (the run directory's
    timeouts.json, or a checkpoint's extras): refused in one line naming the field, nothing merged."""
    config = MonitorConfig.from_dict({"metrics": {"prometheus": False, "tensorboard": False}})
    monitor = NodeMonitor(config, tmp_path, [])
    fresh = monitor.state_dict()
    assert set(fresh) == set(_full_state()) and set(fresh["hang"]) == set(_full_state()["hang"])  # a new field needs rows
    paths = _number_paths(_full_state())
    assert len(paths) == 1 + 3 * len(SECTIONS), paths
    state_file = tmp_path / "timeouts.json"
    for path in paths:
        for bad in BAD_NUMBERS:
            state = _full_state()
            node = state
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = bad
            with pytest.raises(ValueError) as e:
                monitor.load_state_dict(state)
            why = str(e.value)
            assert "\n" not in why and (path[-1] in why or path[-1] == "version"), (path, bad, why)
            assert monitor.state_dict() == fresh  # refused whole: nothing was merged
            state_file.write_text(json.dumps(state))  # the same through the file the agent reads
            with pytest.raises(ValueError, match="timeouts.json"):
                monitor.load_state(state_file)
            assert monitor.state_dict() == fresh
    monitor.load_state_dict(_full_state())  # the unforged state merges
    assert monitor.hangs.timeout("forward") == HangConfig().idle_timeout_s  # 5 x 0.5 s, at least the floor
    monitor.close()


@pytest.mark.timeout(60)
def test_the_agent_ignores_a_forged_run_dir_state_and_says_so(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    state_file = run_dir / ".monitors" / "timeouts.json"
    state_file.parent.mkdir(parents=True)
    forged = _full_state()
    forged["hang"]["observed_max_s"] = {s: 1e308 for s in SECTIONS}
    state_file.write_text(json.dumps(forged))
    agent = Agent(AgentConfig(script=str(GPT), run_dir=str(run_dir)))
    try:
        assert agent.monitor.hangs.timeout("forward") == HangConfig().idle_timeout_s  # not Infinity
        assert all(math.isfinite(t) for t in agent.monitor.state_dict()["hang"]["timeouts_s"].values())
    finally:
        agent.close()
    ev = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in ev if e["event"] == "monitor_state_loaded"]
    [ignored] = [e for e in ev if e["event"] == "monitor_state_ignored"]
    assert "observed_max_s" in ignored["reason"] and "1e+308" in ignored["reason"]
    said = [line for line in capfd.readouterr().err.splitlines() if "hang timeouts ignored" in line]
    assert len(said) == 1, said
