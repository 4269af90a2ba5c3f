"""A user's DDP script (examples/train_ddp.py) through faults: bitwise equal to its fault-free run.

gloo's result depends on how a tensor is cut; a DDP rebuilt after a recovery
regroups its buckets, so without the fixed bucket plan 3+ ranks differ.
"""

from __future__ import annotations

import pytest

from jobs import ckpt_diff, run_ddp, survivors_kept_pids

PHASES = ["data", "forward", "backward", "all-reduce", "optimizer", "between-steps"]
STEPS = 2 + 3 * len(PHASES) + 6


def _faults(nproc: int) -> list[dict]:
    """SIGKILL of rank 0 and of the last rank at every phase, an exception, a kill during healing."""
    last = nproc - 1
    faults = [{"kind": "kill", "rank": 0 if i % 2 == 0 else last, "step": 2 + 3 * i, "phase": phase}
              for i, phase in enumerate(PHASES)]
    faults.append({"kind": "raise", "rank": last, "step": STEPS - 5, "phase": "backward"})
    faults.append({"kind": "kill", "rank": 0, "step": STEPS - 3, "phase": "forward"})
    faults.append({"kind": "kill", "rank": 0, "phase": "heal", "step": STEPS - 3})
    return faults


@pytest.mark.timeout(420)
# 2 ranks: test_recovery.py and test_user_ddp.py kill both of them; 3 and 4 are the layouts gloo cuts differently.
@pytest.mark.parametrize("nproc", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_through_kills_at_every_phase_is_bitwise(tmp_path, references, nproc):
    faults = _faults(nproc)
    job = run_ddp(tmp_path / "run", nproc=nproc, steps=STEPS, faults=faults, timeout=400,
                  agent_args=["--max-replacements", str(len(faults))])
    assert job.returncode == 0, f"run failed:\n{job.stderr[-3000:]}"
    assert len(job.of("fault_injected")) == len(faults), job.of("fault_injected")
    injected = {(e["rank"], e["phase"]) for e in job.of("fault_injected")}
    assert {(f["rank"], f["phase"]) for f in faults} == injected
    survivors_kept_pids(job, killed={0, nproc - 1})
    d = ckpt_diff(references.get(nproc, STEPS, script="ddp"), job.run_dir / "final")
    assert d.returncode == 0, f"final state differs from the fault-free run: {d.stdout}{d.stderr}"
    # Nothing was copied to host memory each step: replacements healed from a live replica, point to point.
    healed = job.of("healed")
    assert healed and all(e["bytes_received"] > 0 for e in healed if e.get("from_rank") is not None)
