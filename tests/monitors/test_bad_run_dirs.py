"""Issue 17: ``status`` and ``straggler`` on directories that are not (healthy) runs give one line and exit 2,
``straggler`` never writes into a directory that is not a run, and links placed in ``.monitors/`` are never
written through."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from monitors import EventLog, ProgressReporter
from monitors.persist import monitor_state_path, write_json_atomic
from monitors.stacks import install_stack_dump, stacks_path
from oneline import assert_one_line_exit_2, cli, in_private_mount, namespace_tool


@pytest.mark.timeout(60)
def test_status_on_a_binary_event_log(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_bytes(os.urandom(4096).replace(b"\n", b"\0") + b"\n\xff\xfe{]\n")
    assert_one_line_exit_2(cli("status", str(tmp_path), timeout=50), "holds no event records")
    # Junk lines among real records are skipped, not fatal.
    log = EventLog(tmp_path / "events.jsonl", source="test")
    log.emit("run_start", rank=0, pid=1, world_size=1)
    r = cli("status", str(tmp_path), timeout=50)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_straggler_refuses_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    r = cli("straggler", str(tmp_path), "--off", timeout=50)
    assert_one_line_exit_2(r, "is not a run directory")
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.timeout(60)
def test_straggler_on_a_read_only_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("")
    argv = [sys.executable, "-m", "resilient_train.cli", "straggler", str(run), "--off"]
    if os.geteuid() != 0:  # permissions bind everyone but root
        os.chmod(run, 0o555)
        try:
            r = cli("straggler", str(run), "--off", timeout=50)
        finally:
            os.chmod(run, 0o755)
    elif namespace_tool() is not None:  # root: a read-only bind mount of the run directory, in a namespace
        r = in_private_mount(f"mount --bind {run} {run} && mount -o remount,bind,ro {run}", argv, timeout=50)
    else:
        pytest.skip("root without mount namespaces: nothing here is read-only")
    assert_one_line_exit_2(r, "cannot write to", "Read-only file system" if os.geteuid() == 0 else "Permission")


@pytest.mark.timeout(60)
def test_links_placed_in_monitors_are_not_followed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    stacks = stacks_path(run, 3)
    stacks.parent.mkdir(parents=True)
    stacks.symlink_to(victim)
    assert install_stack_dump(run, 3) is None  # no dump rather than appending to the link's target
    # A rank's progress slot and the agent's saved state replace what sits at their names, never write into it.
    slot_tmp = run / ".monitors" / f".rank4.progress.{os.getpid()}.tmp"
    slot_tmp.symlink_to(victim)
    ProgressReporter(run, 4).close()
    state = monitor_state_path(run)
    state.symlink_to(victim)
    write_json_atomic(state, {"hang": {}})
    assert not state.is_symlink()
    events = run / "events.jsonl"
    events.symlink_to(victim)
    EventLog(events, source="test").emit("x")  # refused (ELOOP), told once on stderr, never raised
    assert victim.read_text() == "precious\n"
