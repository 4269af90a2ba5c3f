"""Megatron's parallel state across generations on real gloo groups: rebuilt, re-pointed, nothing left alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'resilient-train[megatron]')")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("megatron_generations.py")


def _run(out: Path, world: int, *args: str) -> list[list[dict]]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), "0", str(out), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    errors = []
    for p in procs:
        _, err = p.communicate(timeout=240)
        if p.returncode != 0:
            errors.append(err[-3000:])
    assert not errors, "\n".join(errors)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(300)
def test_tp2_dp2_generations_leave_no_group_alive(tmp_path):
    generations = 3
    records = _run(tmp_path, 4, "--tensor", "2", "--generations", str(generations), "--gloo-groups")
    per_generation = None
    for rank, rec in enumerate(records):
        assert len(rec) == generations
        for g in rec:
            # The tracked layer talks over this generation's tensor group, with the layout's members.
            assert g["same_object_as_collection"] and g["repointed"] == 1
            assert g["tp_sum"] == g["tp_expected"] and g["tp_size"] == 2 and g["tp_rank"] == g["tp_rank_expected"]
            assert g["dp_size"] == g["dp_expected"] == 2
            # Flat: each generation builds as many groups as the first, and after the teardown none is alive
            # and only the default group is registered; after it goes, nothing.
            alive = g["after_build"]["alive"]
            per_generation = per_generation or alive
            assert alive == per_generation > 0
            assert g["after_build"]["built"] == per_generation * (g["generation"] + 1)
            assert g["after_teardown"] == {**g["after_teardown"], "alive": 0, "registered": 1}
            assert g["after_destroy"]["alive"] == 0 and g["after_destroy"]["registered"] == 0
            assert g["layer_group"].startswith("LayoutGroup('tp'")
            if g["generation"] > 0:
                # destroy_model_parallel leaves rank lists behind: the teardown found and reset them.
                assert "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS" in g["stale"], rank


@pytest.mark.timeout(300)
def test_the_census_sees_what_destroy_model_parallel_leaves(tmp_path):
    """The same job torn down by Megatron's destroy_model_parallel alone: its groups stay registered."""
    records = _run(tmp_path, 2, "--tensor", "2", "--generations", "2", "--megatron-only")
    for rec in records:
        for g in rec:
            left = g["after_teardown"]
            assert left["registered"] > 1 and left["alive"] > 0  # only its gloo groups were destroyed


@pytest.mark.timeout(120)
def test_a_group_built_elsewhere_is_refused(tmp_path):
    """A module holding a group the integration did not build would be left on a dead generation."""
    code = f"""
import sys, torch, torch.distributed as dist, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {str(REPO)!r})
from resilient_train.rank.errors import UsageError
from resilient_train.rank.group import build_group
from resilient_train.integrations.megatron.parallel import MegatronConfig, MegatronParallel
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
store = dist.TCPStore("127.0.0.1", 0, 1, True)
mp = MegatronParallel(MegatronConfig(), rank=0, world_size=1)
build_group(store, 0, rank=0, world_size=1, backend="gloo", timeout_s=30, device=torch.device("cpu"))
mine = dist.new_group([0])
cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
layer = ColumnParallelLinear(8, 8, config=cfg, init_method=cfg.init_method, bias=False, tp_group=mine)
mp.build(0)
try:
    mp.track(layer)
except UsageError as e:
    print("refused:", e)
    sys.exit(0)
sys.exit(1)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ColumnParallelLinear.tp_group holds a process group the Megatron integration did not build" in p.stdout


def test_layout_groups_answer_rank_and_size_only():
    from resilient_train.integrations.megatron.groups import LayoutGroup

    g = LayoutGroup("tp", 1, 2)
    assert (g.rank(), g.size()) == (1, 2)
    with pytest.raises(RuntimeError, match="'tp' process group does not exist"):
        g.allreduce([torch.zeros(1)])
