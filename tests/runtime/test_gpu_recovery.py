"""The kill-and-recover test with NCCL on two GPUs (skipped without them)."""

from __future__ import annotations

import pytest
import torch

from jobs import ckpt_diff, run_gpt, survivors_kept_pids

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (NCCL): run on a GPU machine",
)

STEPS = 30


@pytest.mark.timeout(600)
def test_nccl_sigkill_and_exception_recover_bitwise(tmp_path):
    reference = run_gpt(tmp_path / "reference", nproc=2, steps=STEPS, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    faults = [
        {"kind": "kill", "rank": 1, "step": 8, "phase": "backward"},  # survivor blocked in an NCCL all-reduce
        {"kind": "raise", "rank": 0, "step": 16, "phase": "all-reduce"},
        {"kind": "kill", "rank": 0, "step": 22, "phase": "optimizer"},
    ]
    job = run_gpt(tmp_path / "faulted", nproc=2, steps=STEPS, faults=faults, timeout=400)
    assert job.returncode == 0, job.stderr[-3000:]
    assert len(job.of("fault_injected")) == 3
    survivors_kept_pids(job, killed={0, 1})
    assert {e["generation"] for e in job.of("recovery_done")} >= {1, 2}
    d = ckpt_diff(reference.run_dir / "final", job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr
