"""Misuse is loud, not silent (issue 25 item 3): each a real ``resilient-train run`` job or real gloo groups.

* a world of 2 that steps its optimizer with no reducer stops at step 0 with one line;
* a DDP built inside the step gets the plan's hook in every generation (bitwise as one built in
  ``on_new_group``), and one kept from an earlier generation is refused;
* parameters of several floating-point dtypes reduce in place, one dtype a bucket, the same bits in every
  generation; other dtypes are refused at ``sup.ddp()``;
* ``TrainState(model=sup.ddp(model))`` holds the bare model's keys, through a heal;
* a batch drawn with ``next(iterator)`` is named when its step is redone after a recovery.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from jobs import ckpt_diff, console_lines, run_script

from resilient_train.rank.buckets import BucketPlan
from resilient_train.rank.ddp import PlannedDDP, ReplicatedModule, fix_buckets
from resilient_train.rank.errors import UsageError
from resilient_train.rank.reducer import GradientReducer, ReducerHooks

SCRIPT = Path(__file__).resolve().parent / "misuse_script.py"
STOPPED = 93


def _run(tmp_path: Path, mode: str, **kwargs):
    kwargs.setdefault("agent_args", ["--no-spare"])
    return run_script(tmp_path / mode, SCRIPT, [mode], nproc=2, timeout=120, **kwargs)


def _stop_line(job) -> str:
    lines = [line for line in console_lines(job.stderr) if line.startswith("resilient-train:")]
    assert len(lines) == 1, job.stderr
    return lines[0]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["no-reducer", "ddp-bypassed"])
def test_gradients_no_reducer_averaged_are_refused_at_the_first_step(tmp_path, mode):
    job = _run(tmp_path, mode)
    assert job.returncode == STOPPED, job.stderr[-3000:]
    line = _stop_line(job)
    assert "no reducer averaged" in line and "sup.ddp(model)" in line and "ctx.average_gradients()" in line, line
    (stopped,) = job.of("job_stopped")
    assert stopped["step"] == 0 and stopped["generation"] == 0
    assert not job.of("step_done") and not job.of("final_state_written")


@pytest.mark.timeout(200)
def test_a_ddp_built_inside_the_step_gets_the_plans_hook_in_every_generation(tmp_path):
    job = _run(tmp_path, "ddp-in-step")  # rank 1 raises once at step 3: generation 1 builds its DDP again
    assert job.returncode == 0, job.stderr[-3000:]
    adopted = sorted((e["rank"], e["generation"], e["step"]) for e in job.of("ddp_adopted_in_step"))
    assert adopted == [(0, 0, 0), (0, 1, 3), (1, 0, 0), (1, 1, 3)], adopted
    # The same bits as the same script with its DDP built in on_new_group, without the fault.
    ref = _run(tmp_path, "ddp-user")
    assert ref.returncode == 0, ref.stderr[-3000:]
    d = ckpt_diff(ref.run_dir / "final", job.run_dir / "final")
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(150)
def test_a_ddp_built_inside_the_step_once_is_refused_in_the_next_generation(tmp_path):
    job = _run(tmp_path, "ddp-in-step-once")
    assert job.returncode == STOPPED, job.stderr[-3000:]
    line = _stop_line(job)
    assert "a DistributedDataParallel built in an earlier generation is still in use in generation 1" in line, line
    assert "sup.ddp(model)" in line
    (stopped,) = job.of("job_stopped")
    assert stopped["step"] == 3 and stopped["generation"] == 1


@pytest.mark.timeout(200)
def test_train_state_of_sup_ddp_holds_the_bare_models_keys_through_a_heal(tmp_path):
    kill = [{"kind": "kill", "rank": 1, "step": 5, "phase": "backward"}]
    job = _run(tmp_path, "state-ddp", faults=kill, agent_args=[])
    assert job.returncode == 0, job.stderr[-3000:]
    assert [e["rank"] for e in job.of("healed") if e["bytes_received"]] == [1], job.of("healed")
    ref = _run(tmp_path, "state-bare")
    assert ref.returncode == 0, ref.stderr[-3000:]
    d = ckpt_diff(ref.run_dir / "final", job.run_dir / "final")  # the same keys, the same bits
    assert d.returncode == 0, d.stdout + d.stderr


@pytest.mark.timeout(150)
def test_a_batch_that_is_not_a_function_of_the_step_is_named_when_the_step_is_redone(tmp_path):
    job = _run(tmp_path, "iterator")  # rank 1 raises at step 3 once rank 0 fed its model step 3's batch
    assert job.returncode == STOPPED, job.stderr[-3000:]
    line = _stop_line(job)
    assert "step 3 fed the model other inputs when it was computed again" in line, line
    assert "not a function of the step" in line and "next(iterator)" in line, line
    (event,) = job.of("batch_not_replayable")
    assert (event["rank"], event["step"], event["data_rank"], event["call"]) == (0, 3, 0, 0), event
    assert job.of("recovery_done"), "the step was redone in the next generation"


# ---- parameters of several dtypes: real gloo groups, 3 ranks (gloo's sum depends on the cut from 3 on)

class _Mixed(torch.nn.Module):
    """fp32, fp64, bf16, fp32, fp16 layers: with a large bucket the two fp32 layers share one bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8).double()
        self.c = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.d = torch.nn.Linear(8, 8)
        self.e = torch.nn.Linear(8, 8).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c(self.b(self.a(x).double()).bfloat16()).float()
        return self.e(self.d(h).half()).float().pow(2).sum()


def _mixed_worker(rank: int, world: int, store_dir: str, bucket_mb: float, out: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, object] = {}

    def group(name: str) -> None:  # a generation: a new default group on its own store
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(store_dir) / name), world), rank=rank,
                                world_size=world)

    def build(kind: str) -> tuple[torch.nn.Module, torch.nn.Module, GradientReducer]:
        torch.manual_seed(0)
        model = _Mixed()
        reducer = GradientReducer(list(model.parameters()), ReducerHooks(vote=lambda: 1.0), bucket_mb=bucket_mb)
        net: torch.nn.Module = model
        if kind == "planned":
            net = PlannedDDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
            fix_buckets(net)  # type: ignore[arg-type]
            reducer.register(net, planned=True)  # type: ignore[arg-type]
        elif kind == "user":
            net = DDP(model)
            reducer.register(net)
        return model, net, reducer

    def step(model: torch.nn.Module, net: torch.nn.Module, reducer: GradientReducer, i: int) -> list[torch.Tensor]:
        reducer.reset()
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(100 * i + rank)
        net(torch.randn(4, 8)).backward()
        if net is model:
            reducer.reduce_all()
        assert reducer.vote_sum() == world
        return [p.grad.clone() for p in model.parameters()]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))

    group("g0")
    model, net, reducer = build("planned")
    late = [step(model, net, reducer, i) for i in range(3)]
    plan = reducer.plan
    results["dtypes"] = [sorted({str(plan.order[i].dtype) for i in b}) for b in plan.buckets]
    results["copied"] = reducer.copied_buckets
    results["checked"] = sorted(reducer._checked.items())
    group("g1")  # a new group and a new DDP: batch 2 as its first iteration
    model, net, reducer = build("planned")
    results["first_equals_late"] = same(step(model, net, reducer, 2), late[2])
    model, net, reducer = build("all")
    results["all_equals"] = same(step(model, net, reducer, 2), late[2])
    model, net, reducer = build("user")
    results["user_equals"] = all(same(step(model, net, reducer, i), late[i]) for i in range(3))
    dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as test_reducer's workers: no group destructor on this thread at the very end


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket_mb", [25.0, 400 / 2**20])  # one bucket a dtype; several
def test_parameters_of_several_dtypes_reduce_in_place_one_dtype_a_bucket_the_same_bits_every_generation(
        tmp_path, bucket_mb):
    out = tmp_path / "results.pt"
    mp.start_processes(_mixed_worker, args=(3, str(tmp_path), bucket_mb, str(out)), nprocs=3, start_method="spawn")
    r = torch.load(out)
    assert all(len(d) == 1 for d in r["dtypes"]), r  # no bucket mixes dtypes
    assert {d[0] for d in r["dtypes"]} == {"torch.float32", "torch.float64", "torch.bfloat16", "torch.float16"}
    assert r["copied"] == 0 and all(ok for _, ok in r["checked"]) and len(r["checked"]) == len(r["dtypes"]), r
    assert r["first_equals_late"] and r["all_equals"] and r["user_equals"], r


@pytest.mark.timeout(30)
def test_parameters_that_are_not_real_floating_point_are_refused_at_sup_ddp():
    model = torch.nn.Linear(2, 2)
    model.z = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(UsageError, match=r"sup.ddp\(model\): .* z \(torch.complex64\) is not"):
        ReplicatedModule(model, {})
    with pytest.raises(UsageError, match="real floating-point"):
        BucketPlan(list(model.parameters()))
