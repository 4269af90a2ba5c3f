"""Issue 17: every bad input to ``run`` and ``demo`` is one line on stderr and exit 2, before any worker
starts, and leaves no process behind. The run directory is locked by its job and private to its owner."""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import GPT, SMALL_GPT
from oneline import REPO, assert_one_line_exit_2, cli, session_members

HOLD = Path(__file__).resolve().parent / "hold_script.py"  # prints "ready", then waits for a line on stdin

LAUGHS = """a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: [*f, *f, *f, *f, *f, *f, *f, *f, *f]
"""


def _run(tmp_path: Path, *flags: str) -> str:
    r = cli("run", "--no-spare", "--run-dir", str(tmp_path / "run"), *flags, str(GPT), "--steps", "2", timeout=60)
    return assert_one_line_exit_2(r)


MONITOR_CONFIGS = {
    "bad-yaml": ("hang: {idle_timeout_s: [", "not valid YAML"),
    "hang-list": ("hang: [1, 2]", "hang must be a mapping"),
    "port": ("metrics: {prometheus_port: 99999}", "prometheus_port must be in [0, 65535]"),
    "nan": ("hang: {idle_timeout_s: .nan}", "finite"),
    "billion-laughs": (LAUGHS, "aliases"),
    "unbindable-host": ("metrics: {prometheus_host: 192.0.2.1}", "cannot serve Prometheus on 192.0.2.1"),
    "duplicate-key": ("hang: {default_timeout_s: 5}\nhang: {default_timeout_s: 600}", "key 'hang' given twice"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(MONITOR_CONFIGS))
def test_bad_monitor_config(tmp_path: Path, case: str) -> None:
    text, needle = MONITOR_CONFIGS[case]
    path = tmp_path / "monitor.yaml"
    path.write_text(text)
    line = _run(tmp_path, "--monitor-config", str(path))
    assert needle in line and ("monitor.yaml" in line or "metrics" in line), line


@pytest.mark.timeout(60)
def test_monitor_config_missing_or_a_directory(tmp_path: Path) -> None:
    assert "does not exist" in _run(tmp_path, "--monitor-config", str(tmp_path / "nope.yaml"))
    assert "is a directory" in _run(tmp_path, "--monitor-config", str(tmp_path))


@pytest.mark.timeout(60)
def test_a_key_given_twice_in_a_config_file_is_refused_naming_it_and_its_lines(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys silently: a setting its author believes in would be dropped."""
    path = tmp_path / "run.yaml"
    path.write_text("checkpoint:\n  interval: 10\n  keep_last: 2\n  interval: 25\n")
    line = _run(tmp_path, "--config", str(path))
    assert line == (f"resilient-train: error: --config {str(path)!r}: not valid YAML: key 'interval' given twice "
                    "(first on line 2) (line 4, column 3)"), line


CHAOS = {
    "not-json": ("{", "not valid JSON"),
    "unknown-kind": (json.dumps([{"kind": "melt", "rank": 0, "phase": "forward"}]), "unknown kind 'melt'"),
    "rank-9-of-2": (json.dumps([{"kind": "kill", "rank": 9, "phase": "forward"}]), "rank 9 does not exist"),
    # 20,000 faults do not even fit on a command line (E2BIG): a scenario holds those (tests/chaos). One more
    # than the limit does fit.
    "too-many": (json.dumps([{"kind": "kill", "rank": 0, "phase": "forward"}] * 1001, separators=(",", ":")),
                 "1001 faults; at most 1000"),
    "nan-duration": ('[{"kind": "slow", "rank": 0, "phase": "forward", "duration_s": NaN}]', "finite"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CHAOS))
def test_bad_chaos(tmp_path: Path, case: str) -> None:
    text, needle = CHAOS[case]
    line = _run(tmp_path, "--nproc-per-node", "2", "--chaos", text)
    assert line.startswith("resilient-train: error: --chaos:") and needle in line, line
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no worker, not even an agent, started


@pytest.mark.timeout(60)
def test_too_many_ranks_for_this_node(tmp_path: Path) -> None:
    from monitors import max_local_ranks

    line = _run(tmp_path, "--nproc-per-node", "1000")
    assert f"at most {max_local_ranks()} ranks" in line


@pytest.mark.timeout(60)
def test_demo_run_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    r = cli("demo", "--run-dir", str(tmp_path / "f"), timeout=60)
    assert "exists and is not a directory" in assert_one_line_exit_2(r)
    r = cli("demo", "--run-dir", str(tmp_path / "f" / "sub"), timeout=60)
    assert "not a writable directory" in assert_one_line_exit_2(r)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["events.jsonl", ".monitors", "checkpoints"])
def test_a_link_where_the_runtime_writes_is_refused(tmp_path: Path, name: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir() if name != "events.jsonl" else victim.write_text("precious\n")
    (run / name).symlink_to(victim)
    assert "is a symbolic link" in _run(tmp_path)
    assert not victim.is_file() or victim.read_text() == "precious\n"


def _start_holder(run_dir: Path) -> subprocess.Popen[str]:
    """A job holding ``run_dir``: its one worker prints "ready" and waits for a line on stdin."""
    p = subprocess.Popen(
        [sys.executable, "-m", "resilient_train.cli", "run", "--no-spare", "--run-dir", str(run_dir), str(HOLD)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        start_new_session=True,
    )
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 90)
    assert ready and p.stdout.readline().strip() == "ready", p.stderr.read() if p.poll() is not None else ""
    return p


@pytest.mark.timeout(240)
def test_a_second_job_on_a_run_dir_is_refused_and_a_crashed_one_leaves_no_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = _start_holder(run)
    try:
        second = cli("run", "--no-spare", "--run-dir", str(run), str(HOLD), input="\n", timeout=90)
        assert f"in use by another job (pid {holder.pid})" in assert_one_line_exit_2(second)
        holder.stdin.write("\n")  # type: ignore[union-attr]
        holder.stdin.close()  # type: ignore[union-attr]
        assert holder.wait(90) == 0
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(30)
    assert not session_members(holder.pid)
    # Ended: the next job takes the directory. Then it is SIGKILLed with its worker: no stale lock.
    crashed = _start_holder(run)
    os.killpg(crashed.pid, signal.SIGKILL)
    crashed.wait(30)
    after = cli("run", "--no-spare", "--run-dir", str(run), str(HOLD), input="\n", timeout=90)
    assert after.returncode == 0 and not after.leftovers, after.stderr
    assert stat.S_IMODE(run.stat().st_mode) == 0o700


@pytest.mark.timeout(120)
def test_run_dir_is_made_private(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    r = cli("run", "--no-spare", "--run-dir", str(run), str(HOLD), input="\n", timeout=90)
    assert r.returncode == 0 and not r.leftovers, r.stderr
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    fresh = tmp_path / "a" / "fresh"
    r = cli("run", "--no-spare", "--run-dir", str(fresh), str(HOLD), input="\n", timeout=90)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


@pytest.mark.timeout(240)
def test_resuming_past_the_last_step_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A run directory whose checkpoint is at step 10, started again with --steps 5: one line, exit 2, nothing
    loaded (it was a traceback and exit 93). With --steps 10 there is nothing left to train: it finishes."""
    run = tmp_path / "run"

    def job(steps: int):
        return cli("run", "--no-spare", "--nproc-per-node", "1", "--run-dir", str(run), str(GPT), "--steps",
                   str(steps), *SMALL_GPT, "--ckpt-every", "5", "--ckpt-mode", "disabled", timeout=150)

    first = job(10)
    assert first.returncode == 0, first.stderr
    line = assert_one_line_exit_2(job(5))
    assert line == (f"resilient-train: job stopped: rank 0 stopped it: steps=5 is below step 10 of the checkpoint it "
                    f"would resume from ({run / 'checkpoints'}): train to step 10 or more, or start in another run "
                    "directory (exit code 2)"), line
    done = job(10)
    assert done.returncode == 0 and "resumed from the checkpoint of step 10" in done.stderr, done.stderr
