"""One rank of a job that lives through several generations of Megatron's parallel state (gloo, CPU).

Each generation: a default group on its own store prefix (as the supervisor
builds it), Megatron's groups on it, a real collective on the groups a tracked
module holds, then the teardown and the default group destroyed. The counts
go to OUT/rank{r}.json.

    python megatron_generations.py RANK WORLD PORT OUT --tensor T --generations G    (PORT 0: any free port)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def _store(a: argparse.Namespace) -> dist.TCPStore:
    """Port 0: rank 0 binds a free port and writes it to OUT/port, the others read it (no port is guessed)."""
    if a.port or a.rank == 0:
        store = dist.TCPStore("127.0.0.1", a.port, a.world, a.rank == 0, timeout=timedelta(seconds=60),
                              wait_for_workers=False)
        if a.rank == 0 and not a.port:
            tmp = os.path.join(a.out, "port.tmp")
            with open(tmp, "w") as f:
                f.write(str(store.port))
            os.replace(tmp, os.path.join(a.out, "port"))
        return store
    deadline = time.monotonic() + 60
    path = os.path.join(a.out, "port")
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never wrote its store's port")
        time.sleep(0.05)
    with open(path) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, a.world, False, timeout=timedelta(seconds=60))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("port", type=int)
    p.add_argument("out")
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--pipeline", type=int, default=1)
    p.add_argument("--generations", type=int, default=3)
    p.add_argument("--gloo-groups", action="store_true")
    p.add_argument("--megatron-only", action="store_true",
                   help="tear down with Megatron's destroy_model_parallel alone (what the integration replaces)")
    a = p.parse_args()

    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from resilient_train.rank.group import build_group, destroy_group
    from resilient_train.integrations.megatron.parallel import MegatronConfig, MegatronParallel

    store = _store(a)
    parallel = MegatronParallel(MegatronConfig(tensor=a.tensor, pipeline=a.pipeline, gloo_groups=a.gloo_groups),
                                rank=a.rank, world_size=a.world)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, 32, config=config, init_method=config.init_method, bias=False,
                                 gather_output=False, tp_group=parallel.groups.tp)
    parallel.track(layer)
    record = []
    for g in range(a.generations):
        build_group(store, g, rank=a.rank, world_size=a.world, backend="gloo", timeout_s=30,
                    device=torch.device("cpu"))
        parallel.build(g)
        built = parallel.count()
        tp = layer.tp_group
        # The layer's group works: a sum over its ranks, which are those of the layout's tensor group.
        t = torch.tensor([float(a.rank)])
        dist.all_reduce(t, group=tp)
        members = next(grp for grp in parallel.layout.groups("tp") if a.rank in grp)
        dp = parallel.groups.dp
        dp_members = next(grp for grp in parallel.layout.groups("dp") if a.rank in grp)
        record.append({
            "generation": g, "after_build": vars(built), "repointed": parallel.repointed,
            "tp_sum": t.item(), "tp_expected": float(sum(members)), "tp_size": tp.size(), "tp_rank": tp.rank(),
            "tp_rank_expected": members.index(a.rank),
            "dp_size": dp.size(), "dp_expected": len(dp_members),
            "same_object_as_collection": tp is parallel.groups.tp,
        })
        del tp, dp
        if a.megatron_only:
            parallel._ps.destroy_model_parallel()
            parallel._current = None
            parallel._modules = []  # the layer keeps its dead group (the next build would refuse it)
            after = parallel.count()
        else:
            after = parallel.teardown()
        world = destroy_group(torch.device("cpu"))
        del world  # the default group, dropped at once here (no collective is in flight)
        gc.collect()
        final = parallel.count()
        record[-1].update({"after_teardown": vars(after), "after_destroy": vars(final), "stale": parallel.stale,
                           "layer_group": repr(layer.tp_group)})
    with open(os.path.join(a.out, f"rank{a.rank}.json"), "w") as f:
        json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
