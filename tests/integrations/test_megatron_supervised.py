"""A Megatron-Core model under the supervisor on CPU: faults recovered, bitwise, no process group left alive.

The model is ``examples/train_megatron_gpt.py --arch mlp`` (Megatron's tensor-parallel
layers; its GPTModel needs CUDA), 2 gloo ranks, TP = PP = 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import REPO, Job, ckpt_diff, cli

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'resilient-train[megatron]')")

EXAMPLE = REPO / "examples" / "train_megatron_gpt.py"
SMALL = ["--arch", "mlp", "--hidden", "32", "--layers", "2", "--seq-len", "16", "--vocab", "64", "--batch", "4",
         "--reproducible", "--backend", "gloo"]
STEPS = 12


def _run(run_dir: Path, faults: list[dict] | None = None) -> Job:
    args = ["run", "--nproc-per-node", "2", "--run-dir", str(run_dir)]
    if faults:
        args += ["--chaos", json.dumps(faults)]
    p = cli(*args, str(EXAMPLE), "--steps", str(STEPS), *SMALL, timeout=240)
    return Job(p.returncode, p.stdout, p.stderr, run_dir)


@pytest.mark.timeout(600)
def test_kill_and_exception_recover_bitwise_with_no_group_left(tmp_path):
    reference = _run(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    faults = [{"kind": "kill", "rank": 1, "step": 4, "phase": "backward"},
              {"kind": "raise", "rank": 0, "step": 8, "phase": "all-reduce"}]
    job = _run(tmp_path / "faulted", faults)
    assert job.returncode == 0, job.stderr[-3000:]
    assert len(job.of("fault_injected")) == 2
    assert len({e["generation"] for e in job.of("recovery_done")}) >= 2
    d = ckpt_diff(reference.run_dir / "final", job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr

    census = job.of("megatron_groups")
    generations = {e["generation"] for e in census}
    assert len(generations) >= 3  # the first, and one per recovery
    # Flat: every generation on every rank has exactly one generation's groups alive (the earlier ones are
    # gone), and the model's group attributes were re-pointed each time.
    per_generation = census[0]["alive"]
    assert per_generation > 0
    assert all(e["alive"] == per_generation and e["repointed"] == census[0]["repointed"] > 0 for e in census), census
    assert job.of("megatron_groups_leaked") == []
