"""The rerun state machine with NCCL on two GPUs (skipped without them)."""

from __future__ import annotations

import pytest
import torch

from jobs import ckpt_diff, run_gpt

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (NCCL): run on a GPU machine",
)

STEPS = 20
VALIDATE = ["--rerun-mode", "validate_results"]


@pytest.mark.timeout(600)
def test_nccl_transient_persistent_genuine(tmp_path):
    reference = run_gpt(tmp_path / "reference", nproc=2, steps=STEPS, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    faults = [
        {"kind": "nan", "rank": 0, "step": 6, "phase": "forward"},
        {"kind": "bitflip", "rank": 1, "step": 12, "phase": "all-reduce"},
    ]
    job = run_gpt(tmp_path / "faulted", nproc=2, steps=STEPS, faults=faults, extra=VALIDATE, timeout=400)
    assert job.returncode == 0, job.stderr[-3000:]
    decisions = [(e["classification"], e["rank"], e["step"]) for e in job.of("rerun_decision")]
    assert decisions == [("transient", 0, 6), ("persistent", 1, 12)]
    assert [e["rank"] for e in job.of("worker_spawned") if e["replacement"]] == [1]
    d = ckpt_diff(reference.run_dir / "final", job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr

    # A spiking batch: the peer GPU computes the same values bit for bit, so it is genuine.
    spike = run_gpt(tmp_path / "spike", nproc=2, steps=STEPS, extra=VALIDATE, timeout=400,
                    faults=[{"kind": "spike", "rank": 1, "step": 9, "phase": "data"}])
    assert spike.returncode == 0, spike.stderr[-3000:]
    assert [(e["classification"], e["rank"]) for e in spike.of("rerun_decision")] == [("genuine", 1)]
