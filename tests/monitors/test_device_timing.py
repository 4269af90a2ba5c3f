"""CUDA-event section timing (monitors.device_timing): a GPU rank's sections are
timed on the device, so work that is only queued in "forward" is charged to
"forward", not to wherever the CPU next waits. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from monitors.progress import ProgressReporter
from monitors.progressreader import ProgressReader
from monitors.straggler import StragglerConfig, StragglerDetector

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine")

STEPS = 12
FORWARD_S = 0.02


def _cycles_per_s() -> float:
    """``torch.cuda._sleep`` spins for a number of clock cycles: measure how many make a second."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (start.elapsed_time(end) / 1e3)


def _train(run_dir, rank: int, forward_s: float, cycles_per_s: float, *, steps: int = STEPS,
           min_gap_s: float = 0.0) -> None:
    """A step whose GPU work is queued in forward and waited for in the all-reduce, as with NCCL."""
    rep = ProgressReporter(run_dir, rank, cuda_device=torch.device("cuda", 0), cuda_min_gap_s=min_gap_s)
    for step in range(steps):
        rep.enter("data", step)
        rep.enter("forward", step)
        torch.cuda._sleep(int(forward_s * cycles_per_s))  # returns at once: the kernel is only queued
        rep.enter("backward", step)
        rep.enter("all-reduce", step)
        torch.cuda.synchronize()  # the CPU waits here
        rep.enter("optimizer", step)
    rep.enter("between-steps", steps - 1)
    torch.cuda.synchronize()
    rep.enter("data", steps)  # closes the last step and reads the completed events into the slot
    rep.close()  # reads whatever else completed


@pytest.mark.timeout(120)
def test_queued_gpu_work_is_charged_to_the_section_that_queued_it(tmp_path) -> None:
    cps = _cycles_per_s()
    _train(tmp_path, 0, FORWARD_S, cps)
    reader = ProgressReader(tmp_path, 0)
    records = reader.steps(reader.read(), 0)
    assert len(records) == STEPS
    timed = [r for r in records if r.device_sections_s is not None]
    assert len(timed) >= STEPS - 1, [r.device_pending for r in records]
    for r in timed[1:]:  # step 0 pays for warm-up
        dev, wall = r.device_sections_s, r.sections_s
        assert dev["forward"] == pytest.approx(FORWARD_S, rel=0.25), dev
        assert wall["forward"] < dev["forward"] / 3, (wall, dev)  # the CPU only queued it
        assert wall["all-reduce"] > 3 * dev["all-reduce"], (wall, dev)  # and waited for it here
    reader.close()


@pytest.mark.timeout(120)
def test_straggler_scores_use_device_time(tmp_path) -> None:
    cps = _cycles_per_s()
    _train(tmp_path, 0, FORWARD_S, cps)
    _train(tmp_path, 1, 2 * FORWARD_S, cps)  # twice the GPU work, the same launches
    det = StragglerDetector(StragglerConfig(report_interval_s=1.0, patience=1, min_steps=3), tmp_path, [0, 1])
    report = det.report()
    s0, s1 = report.scores[0], report.scores[1]
    assert (s0.clock, s1.clock) == ("cuda", "cuda")
    assert s1.sections_s["forward"] == pytest.approx(2 * s0.sections_s["forward"], rel=0.25)
    assert s0.relative == 1.0 and s1.relative < 0.6, (s0, s1)
    assert [d.rank for d in report.flagged] == [1]
    det.close()


@pytest.mark.timeout(120)
def test_short_steps_are_sampled_by_step_number(tmp_path) -> None:
    cps = _cycles_per_s()
    _train(tmp_path, 0, 0.004, cps, steps=80, min_gap_s=0.05)  # about 4 ms a step: one in 16 timed
    reader = ProgressReader(tmp_path, 0)
    records = reader.steps(reader.read(), 0)
    timed = [r.step for r in records if r.device_sections_s is not None]
    skipped = [r.step for r in records if r.device_skipped]
    assert len(timed) + len(skipped) + sum(r.device_pending for r in records) == len(records) == 80
    assert skipped and [s for s in timed if s >= 16], (timed, skipped)
    # Once 8 steps are known, only multiples of a power of two >= 4 (4 ms x 4 < 50 ms) are timed.
    assert all(s % 4 == 0 for s in timed if s >= 10), timed
    det = StragglerDetector(StragglerConfig(min_steps=1), tmp_path, [0])
    assert det.report().scores[0].steps == len(timed)  # only the timed steps are scored
    reader.close()
    det.close()
