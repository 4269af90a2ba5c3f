"""One rank of a sharded-checkpoint test job: DTensors on a real gloo mesh, saved and loaded by the manager.

``--mesh`` is the layout: ``fsdp`` (one dimension, every tensor sharded over it),
``hsdp`` (2 × N/2: replicated over the first dimension, sharded over the second)
or ``tpdp`` (2 × N/2 like TP × DP: each DTensor lives on the second dimension's
sub-mesh only, so it does not know its replicas; the first replica is the rank
at dp coordinate 0, unless ``--first`` says otherwise). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from checkpointing import CheckpointConfig, CheckpointManager, diff_states
from checkpointing.tree import map_leaves


def reference() -> dict:
    """The whole state: uneven rows (10 over 3 or 4 ranks), a column-sharded matrix, an empty tensor, a scalar."""
    g = torch.Generator().manual_seed(7)
    return {
        "model": {"w": torch.randn(10, 6, generator=g), "c": torch.randn(5, 9, generator=g),
                  "b": torch.randn(7, generator=g).to(torch.bfloat16), "e": torch.zeros(0, 6), "s": torch.tensor(3.0)},
        "optim": {"state": {"w": {"exp_avg": torch.randn(10, 6, generator=g), "step": torch.tensor(4.0)}},
                  "param_groups": [{"lr": 0.25, "params": ["w"]}]},
    }


def layout(kind: str, world: int, rank: int) -> tuple[object, list, bool]:
    """The mesh each DTensor lives on, its placements for a row shard, and whether this rank is a first replica."""
    if kind == "fsdp":
        return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)), [Shard(0)], True
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "shard"))
    if kind == "hsdp":
        return mesh, [Replicate(), Shard(0)], True
    assert kind == "tpdp"
    return mesh["shard"], [Shard(0)], rank // (world // 2) == 0


def sharded(state: dict, mesh: object, rows: list) -> dict:
    cols = [Shard(1) if p == Shard(0) else p for p in rows]
    model = state["model"]
    out = {
        "model": {"w": distribute_tensor(model["w"], mesh, rows, src_data_rank=None),
                  "c": distribute_tensor(model["c"], mesh, cols, src_data_rank=None),
                  "b": distribute_tensor(model["b"], mesh, rows, src_data_rank=None),
                  "e": distribute_tensor(model["e"], mesh, rows, src_data_rank=None), "s": model["s"].clone()},
        "optim": {"state": {"w": {"exp_avg": distribute_tensor(state["optim"]["state"]["w"]["exp_avg"], mesh, rows,
                                                               src_data_rank=None),
                                  "step": state["optim"]["state"]["w"]["step"].clone()}},
                  "param_groups": state["optim"]["param_groups"]},
    }
    return out


def whole(tree: object) -> object:
    return map_leaves(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, tree)


def zeros_like(tree: object) -> object:
    return map_leaves(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, tree)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--mesh", choices=["fsdp", "hsdp", "tpdp"], default="fsdp")
    p.add_argument("--save", type=int, default=None, help="save the state as this step")
    p.add_argument("--load", action="store_true", help="load the newest step into this layout")
    p.add_argument("--first", choices=["mesh", "all", "not-rank1"], default="mesh",
                   help="which ranks claim to be the first replica of their shards")
    args = p.parse_args()
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False, timeout=timedelta(seconds=180))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=180))
    mesh, rows, first = layout(args.mesh, args.world, args.rank)
    first = {"mesh": first, "all": True, "not-rank1": first and args.rank != 1}[args.first]
    live = sharded(reference(), mesh, rows)
    live["rng"] = torch.tensor([args.rank])
    config = CheckpointConfig(directory=args.dir, local_keys=("rng",), timeout_s=60, console=False)
    result: dict = {"rank": args.rank}
    with CheckpointManager(config, rank=args.rank, world_size=args.world, store=dist.PrefixStore("ck", store),
                           first_replica=first) as mgr:
        if args.save is not None:
            h = mgr.save(args.save, live, blocking=True)
            result.update(phase=h.phase.value, error=h.error)
        if args.load:
            targets = zeros_like({"model": live["model"], "optim": live["optim"]})
            loaded, manifest = mgr.load(into=lambda m: targets)
            result.update(step=manifest.step, saved_world_size=manifest.world_size,
                          diff=diff_states(whole({k: loaded[k] for k in ("model", "optim")}), reference()),
                          in_place=diff_states(whole(targets), reference()),
                          rng=loaded["rng"].tolist() if "rng" in loaded else None)
    print(json.dumps(result), flush=True)
    # A rank destroying its gloo group while a peer still loads sometimes aborts in torch 2.13
    # ("terminate called without an active exception"): everyone is done first.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
