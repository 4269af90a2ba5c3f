"""One rank saving through MegatronCheckpointer's commit protocol on CPU (gloo).

``dist_checkpointing.save`` needs CUDA; the same ``torch_dist`` layout (a
``__{rank}_0.distcp`` shard per rank and a ``.metadata``) is written here by
``torch.distributed.checkpoint``, which Megatron's strategy writes through.
Steps 1 and 2 are committed; with ``--stray`` step 3's writer also leaves a
subdirectory, which no rank vouches for. Results go to OUT/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def main() -> int:
    rank, world, out, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    stray = "--stray" in sys.argv
    port_file = out / "port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=60), wait_for_workers=False)
        port_file.with_suffix(".tmp").write_text(str(store.port))
        os.replace(port_file.with_suffix(".tmp"), port_file)
    else:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("no port from rank 0")
            time.sleep(0.05)
        store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), world, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))

    from checkpointing.megatron_dist import MegatronCheckpointConfig, MegatronCheckpointer, MegatronCheckpointFailed

    ck = MegatronCheckpointer(MegatronCheckpointConfig(directory=root, keep_last=2, console=False))
    record: dict = {}

    def writer(step: int, with_stray: bool = False):
        def write(tmp: Path) -> None:
            state = {f"w{rank}": torch.full((64,), float(step * 10 + rank))}
            dcp.save(state, checkpoint_id=str(tmp))
            if with_stray and rank == 1:
                (tmp / "stray").mkdir()
            dist.barrier()
        return write

    for step in (1, 2):
        ck.commit_with(step, writer(step), extras={"step_note": step})
    record["latest"] = ck.latest_step()
    if stray:
        try:
            ck.commit_with(3, writer(3, with_stray=True))
            record["stray"] = "committed"
        except MegatronCheckpointFailed as e:
            record["stray"] = str(e)
        record["latest_after_stray"] = ck.latest_step()
    ck.close()
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
