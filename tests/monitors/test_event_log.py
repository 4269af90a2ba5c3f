"""The event log's failed writes: told once, where its owner says (monitors/events.py)."""

from __future__ import annotations

import pytest

from monitors.events import EventLog, read_events


@pytest.mark.timeout(30)
def test_a_failed_write_is_told_once_to_say_and_never_raised(tmp_path):
    target = tmp_path / "events.jsonl"
    target.mkdir()  # a directory where the file should be: every append fails with EISDIR
    said: list[str] = []
    log = EventLog(target, source="agent", say=said.append)
    log.emit("a")
    log.emit("b")
    assert len(said) == 1, said
    assert said[0].startswith(f"cannot write events to {target}: ") and "dropped" in said[0]
    assert not said[0].startswith("resilient-train:")  # the owner's console adds its own prefix


@pytest.mark.timeout(30)
def test_without_say_it_is_told_on_stderr_and_a_rank_tells_nothing(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    EventLog(broken, source="agent").emit("a")
    assert capsys.readouterr().err.startswith(f"resilient-train: cannot write events to {broken}: ")
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    EventLog(quiet, source="rank0", warn=False).emit("a")
    assert capsys.readouterr().err == ""
    good = tmp_path / "good.jsonl"
    EventLog(good, source="rank0").emit("step_done", step=1)
    assert [e["event"] for e in read_events(good)] == ["step_done"]
