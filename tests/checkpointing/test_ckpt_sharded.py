"""Checkpoints of sharded state (DTensor): each rank writes its own chunks once; loads reshard to any layout.

Real processes on a real gloo mesh (``shard_worker.py``). The state has rows
that do not divide evenly, a column-sharded matrix, an empty tensor and plain
tensors; every verdict is bitwise against the whole tensors it was cut from.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from checkpointing import CheckpointError, diff_states, read_state
from checkpointing.dcp_io import METADATA_FILE, load_metadata
from ckpt_helpers import forge_manifest_entry

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from shard_worker import reference  # noqa: E402


def run_ranks(world: int, directory: Path, *args: str, timeout: float = 200) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=timedelta(seconds=180),
                          wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(HERE / "shard_worker.py"), "--rank", str(r), "--world", str(world),
                               "--port", str(store.port), "--dir", str(directory), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def chunk_writers(step_dir: Path) -> dict[str, list[str]]:
    """For each tensor key, the files its chunks were written to (one per chunk)."""
    md = load_metadata(step_dir / METADATA_FILE)
    out: dict[str, list[str]] = {}
    for index, info in md.storage_data.items():
        out.setdefault(index.fqn, []).append(info.relative_path)
    return out


def saved_fsdp(tmp_path_factory) -> Path:
    """A checkpoint root with step 5 saved by 4 FSDP ranks (made once per session)."""
    if "fsdp" not in _saved:
        ck = tmp_path_factory.mktemp("fsdp4") / "ck"
        saved = run_ranks(4, ck, "--mesh", "fsdp", "--save", "5")
        assert all(r["phase"] == "committed" for r in saved), saved
        _saved["fsdp"] = ck
    return _saved["fsdp"]


_saved: dict[str, Path] = {}


@pytest.mark.timeout(400)
def test_fsdp_chunks_are_written_by_their_ranks_and_read_whole(tmp_path_factory):
    step = saved_fsdp(tmp_path_factory) / "step-5"
    writers = chunk_writers(step)
    # Row shards of 10 over 4 ranks: 3, 3, 3, 1; each rank its own file. Plain tensors: rank 0 only.
    assert sorted(writers["model.w"]) == [f"__{r}_0.distcp" for r in range(4)]
    assert writers["model.s"] == ["__0_0.distcp"] and writers["optim.state.w.step"] == ["__0_0.distcp"]
    assert len(writers["model.e"]) == 1  # an empty tensor: one (empty) chunk
    # Read whole (what `ckpt diff` does): every tensor assembled from its chunks, bitwise.
    state, manifest = read_state(step)
    assert manifest.world_size == 4
    assert diff_states({k: state[k] for k in ("model", "optim")}, reference()) is None
    assert state["__ranks__"] == {r: {"rng": torch.tensor([r])} for r in range(4)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,mesh", [(3, "fsdp"), pytest.param(2, "fsdp", marks=pytest.mark.slow),
                                        pytest.param(4, "hsdp", marks=pytest.mark.slow)])
def test_fsdp_checkpoint_loads_resharded(tmp_path_factory, world, mesh):
    """Into DTensors on another layout: 3 ranks (uneven the other way), 2 ranks, HSDP 2 x 2; each rank gets
    the local state its rank saved."""
    loaded = run_ranks(world, saved_fsdp(tmp_path_factory), "--mesh", mesh, "--load")
    assert all(r["step"] == 5 and r["saved_world_size"] == 4 for r in loaded), loaded
    assert all(r["diff"] is None and r["in_place"] is None for r in loaded), loaded
    assert [r["rng"] for r in loaded] == [[r] for r in range(world)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mesh", ["hsdp", "tpdp"])
def test_replicas_write_each_chunk_once(tmp_path, mesh):
    """HSDP's replica groups and TP x DP's dp peers hold the same chunks: only the first replica writes them."""
    ck = tmp_path / "ck"
    saved = run_ranks(4, ck, "--mesh", mesh, "--save", "3")
    assert all(r["phase"] == "committed" for r in saved), saved
    writers = chunk_writers(ck / "step-3")
    # Ranks 0 and 1 are the first replicas (dp coordinate 0); ranks 2 and 3 hold the same chunks.
    assert sorted(writers["model.w"]) == ["__0_0.distcp", "__1_0.distcp"], writers["model.w"]
    assert all(f in ("__0_0.distcp", "__1_0.distcp") for key, fs in writers.items() if not key.startswith("__rank")
               for f in fs), writers
    state, _ = read_state(ck / "step-3")
    assert diff_states({k: state[k] for k in ("model", "optim")}, reference()) is None
    loaded = run_ranks(2, ck, "--mesh", "fsdp", "--load")
    assert all(r["diff"] is None and r["in_place"] is None for r in loaded), loaded


@pytest.mark.timeout(400)
@pytest.mark.parametrize("first,reason", [("not-rank1", "a rank's chunk is missing"), ("all", "twice")],
                         ids=["missing", "doubled"])
def test_a_missing_or_doubled_chunk_is_never_committed(tmp_path, first, reason):
    """Rank 1 wrongly leaves its chunks to a replica that does not write them either; or every dp peer
    claims to be the first replica and the same chunks come twice."""
    ck = tmp_path / "ck"
    bad = run_ranks(4, ck, "--mesh", "tpdp", "--save", "2", "--first", first)
    assert all(r["phase"] == "failed" for r in bad), bad
    assert reason in bad[0]["error"], bad[0]
    assert not [p.name for p in ck.iterdir() if p.name.startswith("step-")]


@pytest.mark.timeout(300)
def test_forged_metadata_with_a_chunk_left_out_is_refused(tmp_path):
    """A .metadata that drops a chunk (and a manifest forged to vouch for it) must not yield a tensor
    with an unread, uninitialised part."""
    ck = tmp_path / "ck"
    assert all(r["phase"] == "committed" for r in run_ranks(2, ck, "--mesh", "fsdp", "--save", "1"))
    step = ck / "step-1"
    md = load_metadata(step / METADATA_FILE)
    entry = md.state_dict_metadata["model.w"]
    dropped = entry.chunks.pop()
    md.storage_data = {i: v for i, v in md.storage_data.items()
                       if not (i.fqn == "model.w" and tuple(i.offset) == tuple(dropped.offsets))}
    (step / METADATA_FILE).write_bytes(pickle.dumps(md))
    forge_manifest_entry(step, METADATA_FILE)
    with pytest.raises(CheckpointError, match="chunks do not make up the tensor"):
        read_state(step)
    d = subprocess.run([sys.executable, "-m", "checkpointing.cli", "diff", str(step), str(step)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert d.returncode == 2 and "chunks do not make up the tensor" in d.stderr, d.stderr
