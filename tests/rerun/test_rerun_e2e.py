"""The rerun state machine on real 4-rank GPT jobs (gloo, real processes, the node agent).

Value faults (chaos.values) make the numbers wrong; the runtime must classify
each case and end where the fault-free run ends (transient, persistent), or
apply the genuine-event policy and say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jobs import GPT, REPO, ckpt_diff, cli, run_gpt, survivors_kept_pids

VALIDATE = ["--rerun-mode", "validate_results"]
STEPS = 12  # the same reference as tests/runtime (shared within a session)
TINY = ["--d-model", "16", "--layers", "1", "--heads", "1", "--seq-len", "8", "--batch", "2", "--log-every", "0"]


def _decisions(job) -> list[tuple[str, int, int]]:
    return [(e["classification"], e["rank"], e["step"]) for e in job.of("rerun_decision")]


@pytest.mark.timeout(300)
def test_transient_and_persistent_end_bitwise_equal(tmp_path, references):
    """A NaN once on rank 1 (transient), then a bit flip in rank 2's gradient from step 8 on (persistent)."""
    faults = [
        {"kind": "nan", "rank": 1, "step": 4, "phase": "forward"},
        {"kind": "bitflip", "rank": 2, "step": 8, "phase": "all-reduce"},
    ]
    job = run_gpt(tmp_path / "run", nproc=4, steps=STEPS, faults=faults, extra=VALIDATE, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert _decisions(job) == [("transient", 1, 4), ("persistent", 2, 8)]
    transient, persistent = job.of("rerun_decision")
    assert transient["first"]["loss"] == "nan" and isinstance(transient["rerun"]["loss"], float)
    assert persistent["peer_rank"] == 3 and persistent["rerun"] == persistent["first"] != persistent["peer"]
    assert [e["rank"] for e in job.of("rerun_excluded")] == [2]
    died = [e for e in job.of("fault_detected") if e["source"] == "agent"]
    assert [(e["rank"], e["how"]) for e in died] == [(2, "exit code 16")]
    assert [e["rank"] for e in job.of("worker_spawned") if e["replacement"]] == [2]
    survivors_kept_pids(job, killed={2})
    summaries = {e["rank"]: e for e in job.of("rerun_summary")}
    assert summaries[0]["counters"]["transient"] == 1 and summaries[0]["suspects"] == [2]
    assert summaries[2]["suspects"] == [2], "the replacement inherits the record"
    d = ckpt_diff(references.get(4, STEPS), job.run_dir / "final")
    assert d.returncode == 0, f"final state differs from the fault-free run: {d.stdout}{d.stderr}"


@pytest.mark.timeout(300)
def test_genuine_spike_on_any_rank_is_skipped(tmp_path):
    """A batch that spikes the loss is genuine wherever it lands (rank 0, then rank 3): skipped, reported."""
    faults = [
        {"kind": "spike", "rank": 0, "step": 6, "phase": "data"},
        {"kind": "spike", "rank": 3, "step": 9, "phase": "data"},
    ]
    job = run_gpt(tmp_path / "run", nproc=4, steps=STEPS, faults=faults, extra=VALIDATE, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert _decisions(job) == [("genuine", 0, 6), ("genuine", 3, 9)]
    for e in job.of("rerun_decision"):
        assert e["first"] == e["rerun"] == e["peer"], "the peer computed the same spike"
    assert [(e["step"], e["ranks"]) for e in job.of("rerun_skipped")] == [(6, [0]), (9, [3])]
    assert not job.of("fault_detected") and not [e for e in job.of("worker_spawned") if e["replacement"]]
    assert {e["counters"]["skipped"] for e in job.of("rerun_summary")} == {2}
    assert job.of("final_state_written")


@pytest.mark.timeout(300)
def test_genuine_with_stop_policy_saves_and_exits_17(tmp_path):
    faults = [{"kind": "spike", "rank": 2, "step": 7, "phase": "data"}]
    job = run_gpt(tmp_path / "run", nproc=4, steps=STEPS, faults=faults, timeout=240,
                  extra=[*VALIDATE, "--rerun-on-genuine", "stop"])
    assert job.returncode == 17, job.stderr[-3000:]
    assert _decisions(job) == [("genuine", 2, 7)]
    (stop,) = job.of("rerun_stop")
    assert stop["exit_code"] == 17 and stop["report"][0]["classification"] == "genuine"
    verify = cli("ckpt", "verify", stop["saved"])
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert not job.of("final_state_written")
    assert not [e for e in job.of("worker_spawned") if e["replacement"]], "a stopped job replaces nobody"


@pytest.mark.timeout(240)
def test_no_rejection_over_500_healthy_steps(tmp_path):
    job = run_gpt(tmp_path / "run", nproc=4, steps=500, extra=[*VALIDATE, *TINY], timeout=200)
    assert job.returncode == 0, job.stderr[-3000:]
    assert not job.of("rerun_rejected") and not job.of("rerun_decision")
    summaries = job.of("rerun_summary")
    assert len(summaries) == 4
    assert all(s["counters"]["steps_validated"] == 500 and s["counters"]["rejected"] == 0 for s in summaries)


@pytest.mark.timeout(120)
def test_report_determinism_stats_single_process(tmp_path):
    """Every step re-run in place and compared bit for bit (one process, no launcher)."""
    env = {**os.environ, "RT_RUN_DIR": str(tmp_path)}
    env.pop("MASTER_PORT", None)
    p = subprocess.run([sys.executable, str(GPT), "--steps", "6", *TINY, "--rerun-mode", "report_determinism_stats"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    checks = [e for e in events if e["event"] == "rerun_determinism"]
    assert [e["step"] for e in checks] == list(range(6)) and all(e["reproduced"] for e in checks)
    (summary,) = [e for e in events if e["event"] == "rerun_summary"]
    assert summary["counters"]["determinism_checks"] == 6 and summary["counters"]["determinism_mismatches"] == 0
