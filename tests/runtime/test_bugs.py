"""Faults are recovered, bugs are not: a bug stops the job once, with its traceback shown once."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import cli, console_lines, run_script

SCRIPT = Path(__file__).resolve().parent / "misuse_script.py"
STOPPED = 93


def _run(tmp_path: Path, mode: str):
    return run_script(tmp_path / mode, SCRIPT, [mode], nproc=2, agent_args=["--no-spare"], timeout=120)


@pytest.mark.timeout(150)
def test_an_exception_that_reproduces_on_its_replay_stops_the_job(tmp_path):
    job = _run(tmp_path, "keyerror")
    assert job.returncode == STOPPED, job.stderr[-3000:]
    assert job.stderr.count("Traceback (most recent call last)") == 1, job.stderr
    assert "KeyError: 'missing'" in job.stderr
    lines = [line for line in console_lines(job.stderr) if line.startswith("resilient-train:")]
    assert len(lines) == 1 and "raised again when step 3 was replayed" in lines[0], lines
    # One recovery, one replay, then the stop: no rollback loop. (A peer may report its own replayed
    # exception in generation 1 before it reads the stop: it goes no further.)
    detected = job.of("fault_detected")
    assert len([e for e in detected if e["generation"] == 0 and e["first_reporter"]]) == 1, detected
    assert {e["generation"] for e in detected} <= {0, 1}, detected
    assert sorted(e["generation"] for e in job.of("recovery_done")) == [1, 1]
    (stopped,) = job.of("job_stopped")
    assert stopped["step"] == 3 and stopped["generation"] == 1
    assert not [e for e in job.of("worker_spawned") if e["replacement"]], "nothing to replace in a bug"
    assert "[rank0]:" not in job.stderr


@pytest.mark.timeout(150)
def test_a_peer_of_the_rank_that_stops_the_job_ends_with_the_stop_and_no_fault_of_its_own(tmp_path):
    """Rank 1's bug reproduces on its replay and stops the job. Rank 0 is woken by the stop (or, if its
    collective fails first, reads it): either way it ends with the stop, reports one fault (the first
    KeyError's, with the cause), and the stop counts as none of its recoveries. Which path rank 0 took is
    not pinned here: tests/runtime/test_coordination.py drives the woken one on a real store."""
    job = _run(tmp_path, "keyerror-rank1")
    assert job.returncode == STOPPED, job.stderr[-3000:]
    (stopped,) = job.of("job_stopped")
    assert stopped["rank"] == 1 and stopped["generation"] == 1
    mine = [e for e in job.of("fault_detected") if e["source"] == "rank0"]
    # One fault for rank 0: the first KeyError's, said once its join brought the cause; the stop is no fault.
    assert [(e["generation"], e["first_reporter"], (e["cause"] or {}).get("rank")) for e in mine] == [(0, False, 1)]
    assert [e["generation"] for e in job.of("recovery_done") if e["source"] == "rank0"] == [1]
    run_end = [e for e in job.of("run_end") if e["source"] == "rank0"]
    assert len(run_end) == 1 and "raised again" in run_end[0]["stopped"] and run_end[0]["recoveries"] == 1


@pytest.mark.timeout(150)
def test_a_transient_exception_is_recovered(tmp_path):
    job = _run(tmp_path, "transient")
    assert job.returncode == 0, job.stderr[-3000:]
    assert [e["step"] for e in job.of("fault_detected") if e["source"] == "rank1"] == [3]
    assert job.of("final_state_written")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode,says", [
    ("ddp-before", "a process group was used before sup.run built one at"),
    ("ddp-once", "a DistributedDataParallel built in an earlier generation is still in use"),
])
def test_ddp_misuse_is_one_line_and_stops(tmp_path, mode, says):
    job = _run(tmp_path, mode)
    assert job.returncode == STOPPED, job.stderr[-3000:]
    lines = console_lines(job.stderr)
    assert len(lines) == 1 and says in lines[0], job.stderr
    assert "sup.ddp(model)" in lines[0]


@pytest.mark.timeout(150)
def test_ddp_built_in_on_new_group_gets_the_fixed_layout_hook(tmp_path):
    job = _run(tmp_path, "ddp-user")
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.of("final_state_written")


@pytest.mark.timeout(200)
def test_rngs_a_script_never_uses_do_not_make_runs_differ(tmp_path):
    """Neither ``random`` nor NumPy is seeded or used: two fault-free runs still compare equal."""
    a, b = _run(tmp_path / "a", "ddp-user"), _run(tmp_path / "b", "ddp-user")
    assert a.returncode == b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    d = cli("ckpt", "diff", str(a.run_dir / "final"), str(b.run_dir / "final"))
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(200)
def test_an_unseeded_rng_in_use_is_named_by_ckpt_diff(tmp_path):
    a, b = _run(tmp_path / "a", "unseeded"), _run(tmp_path / "b", "unseeded")
    assert a.returncode == b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    d = cli("ckpt", "diff", str(a.run_dir / "final"), str(b.run_dir / "final"))
    assert d.returncode == 1 and len(d.stdout.splitlines()) == 1, d.stdout
    assert "rng.python" in d.stdout and "without seeding it" in d.stdout, d.stdout
    every = cli("ckpt", "diff", "--all", str(a.run_dir / "final"), str(b.run_dir / "final"))
    lines = every.stdout.splitlines()
    assert every.returncode == 1 and lines[-1] == f"{len(lines) - 1} difference(s)", every.stdout
    assert {line.split(".rng.")[0] for line in lines[:-1]} == {"state.ranks.0", "state.ranks.1"}, lines
