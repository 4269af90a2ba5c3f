"""The Megatron checkpoint backend's commit protocol on CPU: real files, 2 gloo ranks, checksums, fallback.

The writer is ``torch.distributed.checkpoint`` in Megatron's ``torch_dist`` layout
(``dist_checkpointing.save`` itself needs CUDA: tests/integrations/test_megatron_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpointing.manifest import Manifest, verify_checkpoint
from checkpointing.megatron_dist import FORMAT, MegatronCheckpointConfig, MegatronCheckpointer

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("megatron_ckpt_worker.py")


def _run(out: Path, root: Path, *extra: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(out), str(root), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    errors = []
    for p in procs:
        _, err = p.communicate(timeout=150)
        if p.returncode:
            errors.append(err[-3000:])
    assert not errors, "\n".join(errors)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(200)
def test_every_ranks_shard_is_in_the_manifest_and_a_flipped_byte_falls_back(tmp_path):
    root = tmp_path / "ckpt"
    records = _run(tmp_path, root)
    assert [r["latest"] for r in records] == [2, 2]
    m = verify_checkpoint(root / "step-2")
    assert m.extras == {"step_note": 2, "format": FORMAT} and m.world_size == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(m.files)
    assert (root / "latest").read_text().strip() == "step-2"
    assert not list(root.glob("*.tmp"))

    shard = root / "step-2" / "__1_0.distcp"  # rank 1's own shard, checksummed by rank 1
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(raw)
    events = []

    class Sink:
        def emit(self, event: str, **fields) -> None:
            events.append({"event": event, **fields})

    ck = MegatronCheckpointer(MegatronCheckpointConfig(directory=root, console=False), events=Sink())
    try:
        assert ck.latest_step() == 1
    finally:
        ck.close()
    bad = [e for e in events if e["event"] == "checkpoint_invalid"]
    assert bad and bad[0]["step"] == 2 and bad[0]["file"] == "__1_0.distcp"


@pytest.mark.timeout(200)
def test_a_file_no_rank_vouches_for_fails_the_save_on_every_rank(tmp_path):
    root = tmp_path / "ckpt"
    records = _run(tmp_path, root, "--stray")
    for r in records:
        assert "step 3 was not committed" in r["stray"] and "stray" in r["stray"]
        assert r["latest_after_stray"] == 2
    assert not (root / "step-3").exists()


@pytest.mark.timeout(60)
def test_a_checkpoint_of_the_other_format_is_not_taken(tmp_path):
    from checkpointing.durable import file_sha256
    from checkpointing.manifest import FileEntry

    step = tmp_path / "step-5"
    step.mkdir()
    (step / "data").write_bytes(b"x" * 10)
    size, digest = file_sha256(step / "data")
    Manifest(step=5, world_size=1, files={"data": FileEntry(size=size, sha256=digest)}, tree={"D": []}).write(step)
    verify_checkpoint(step)  # a valid checkpoint ...
    ck = MegatronCheckpointer(MegatronCheckpointConfig(directory=tmp_path, console=False))
    try:
        assert ck.latest_step() is None  # ... but not a Megatron one
    finally:
        ck.close()
