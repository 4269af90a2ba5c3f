"""Megatron-Core's GPTModel under the supervisor on one GPU, and dist_checkpointing commits (skipped without CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from jobs import REPO, Job, ckpt_diff, cli

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device: Megatron's GPT attention and dist_checkpointing.save call CUDA"),
]
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'resilient-train[megatron]')")

EXAMPLE = REPO / "examples" / "train_megatron_gpt.py"
SMALL = ["--arch", "gpt", "--hidden", "256", "--layers", "2", "--heads", "4", "--seq-len", "64", "--vocab", "512",
         "--batch", "4", "--reproducible"]


def _run(run_dir, steps, faults=None) -> Job:
    args = ["run", "--nproc-per-node", "1", "--run-dir", str(run_dir)]
    if faults:
        args += ["--chaos", json.dumps(faults)]
    p = cli(*args, str(EXAMPLE), "--steps", str(steps), *SMALL, timeout=240)
    return Job(p.returncode, p.stdout, p.stderr, run_dir)


@pytest.mark.timeout(600)
def test_gpt_exception_recovered_bitwise_on_one_gpu(tmp_path):
    reference = _run(tmp_path / "reference", 20)
    assert reference.returncode == 0, reference.stderr[-3000:]
    job = _run(tmp_path / "faulted", 20, [{"kind": "raise", "rank": 0, "step": 9, "phase": "backward"}])
    assert job.returncode == 0, job.stderr[-3000:]
    assert len(job.of("fault_injected")) == 1 and job.of("recovery_done")
    leaked = job.of("megatron_groups_leaked")
    assert leaked == [], leaked  # the event names the group and its holders
    census = job.of("megatron_groups")
    assert len({e["generation"] for e in census}) == 2 and len({e["alive"] for e in census}) == 1
    d = ckpt_diff(reference.run_dir / "final", job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(300)
def test_dist_checkpointing_commit_verify_load_and_fallback(tmp_path):
    out = tmp_path / "ckpt.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "megatron_gpu.py"), "--skip-steps", "--out", str(out),
                        "--hidden", "64", "--layers", "2", "--heads", "2", "--seq-len", "32", "--vocab", "128"],
                       capture_output=True, text=True, timeout=280, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    c = json.loads(out.read_text())["checkpoints"]
    assert c["latest"] == 2 and c["load_step"] == 2 and c["load_bitwise"] is True
    assert c["after_corruption_latest"] == 1  # step 2's shard lost a bit: its checksum fails, step 1 is taken
