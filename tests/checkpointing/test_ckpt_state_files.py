from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpointing import CheckpointError, diff_states, read_state, verify_checkpoint, write_state
from checkpointing.cli import main
from ckpt_helpers import evil_pickle, forge_manifest_entry, make_state

pytestmark = pytest.mark.timeout(60)


def test_roundtrip_is_bitwise_and_keeps_plain_types(tmp_path: Path) -> None:
    state = make_state(1)
    path = write_state(tmp_path / "ck", state, step=7, extras={"note": "x"}, run_id="r1")
    assert path == tmp_path / "ck" and not (tmp_path / "ck.tmp").exists()
    loaded, manifest = read_state(path)
    assert diff_states(state, loaded) is None
    assert manifest.step == 7 and manifest.world_size == 1 and manifest.run_id == "r1"
    assert manifest.extras == {"note": "x"}
    assert list(loaded["optim"]["state"]) == [0]  # int keys survive
    assert loaded["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_a_state_is_written_a_piece_at_a_time_and_reads_back_whole(tmp_path: Path) -> None:
    """Streaming: pieces of at most piece_mb (a larger tensor alone), each its own DCP file, one metadata."""
    state = make_state(3)
    sizes = {k: v.numel() * v.element_size() for k, v in state["model"].items()}
    piece_mb = min(sizes.values()) / 2**20  # every tensor a piece of its own
    path = write_state(tmp_path / "ck", state, step=4, piece_mb=piece_mb)
    shards = sorted(p.name for p in path.iterdir() if p.name.endswith(".distcp"))
    assert len(shards) >= len(sizes), shards
    loaded, manifest = read_state(path)
    assert diff_states(state, loaded) is None
    assert set(shards) <= set(manifest.files)  # every piece checksummed in the manifest
    whole = write_state(tmp_path / "one", state, step=4)  # the default piece: one file
    assert sorted(p.name for p in whole.iterdir() if p.name.endswith(".distcp")) == ["__0_0.distcp"]
    assert main(["diff", str(path), str(whole)]) == 0


def test_plain_dcp_load_reads_the_tensors(tmp_path: Path) -> None:
    state = make_state(2)
    path = write_state(tmp_path / "ck", state, step=1)
    template = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "rng": torch.empty(64, dtype=torch.uint8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, checkpoint_id=str(path), no_dist=True)
    assert diff_states(template["model"], state["model"]) is None
    assert torch.equal(template["rng"], state["rng"])


def test_rejects_unsupported_leaves(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported value of type object"):
        write_state(tmp_path / "ck", {"x": object()}, step=0)
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ck.tmp").exists()


def test_diff_reports_first_difference() -> None:
    a = make_state(3)
    b = make_state(3)
    assert diff_states(a, b) is None
    b["optim"]["state"][0]["exp_avg"][2, 5] += 0.5
    d = diff_states(a, b)
    assert d is not None and d.startswith("optim.state.0.exp_avg:") and "[2, 5]" in d and "max abs diff 0.5" in d
    c = make_state(3)
    c["model"]["bias"] = c["model"]["bias"].float()
    assert "dtype torch.bfloat16 vs torch.float32" in str(diff_states(a, c))
    e = make_state(3)
    e["data"]["samples_seen"] += 1
    assert diff_states(a, e) == "data.samples_seen: 1237 vs 1238"
    z1, z2 = {"t": torch.tensor([0.0])}, {"t": torch.tensor([-0.0])}
    assert diff_states(z1, z2) is not None  # bitwise, not numeric


def test_diff_of_checkpoint_directories(tmp_path: Path) -> None:
    a = write_state(tmp_path / "a", make_state(4), step=1)
    b = write_state(tmp_path / "b", make_state(4), step=2)
    assert diff_states(a, b) is None
    s = make_state(4)
    s["rng"][10] ^= 1
    c = write_state(tmp_path / "c", s, step=1)
    assert "state.rng: 1 of 64 elements differ; first at index [10]" in str(diff_states(a, c))


def test_truncated_shard_is_named(tmp_path: Path) -> None:
    path = write_state(tmp_path / "ck", make_state(), step=1)
    shard = path / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 10)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: size .* \(truncated\?\)") as e:
        read_state(path)
    assert e.value.file == "__0_0.distcp"


def test_flipped_byte_is_named(tmp_path: Path) -> None:
    path = write_state(tmp_path / "ck", make_state(), step=1)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch") as e:
        verify_checkpoint(path)
    assert e.value.file == "__0_0.distcp"


def test_missing_and_edited_manifest(tmp_path: Path) -> None:
    path = write_state(tmp_path / "ck", make_state(), step=1)
    data = json.loads((path / "manifest.json").read_text())
    data["step"] = 2  # edited without recomputing the self checksum
    (path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="manifest checksum mismatch"):
        read_state(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="missing manifest") as e:
        read_state(path)
    assert e.value.file == "manifest.json"


def test_manifest_from_another_run(tmp_path: Path) -> None:
    path = write_state(tmp_path / "ck", make_state(), step=1, run_id="run-a")
    with pytest.raises(CheckpointError, match="belongs to run 'run-a'"):
        read_state(path, run_id="run-b")


def test_crafted_metadata_does_not_execute(tmp_path: Path) -> None:
    path = write_state(tmp_path / "ck", make_state(), step=1)
    sentinel = tmp_path / "pwned"
    (path / ".metadata").write_bytes(evil_pickle(sentinel))
    forge_manifest_entry(path, ".metadata")
    verify_checkpoint(path)  # the forged manifest vouches for it...
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable DCP metadata: refused to load posix.system"):
        read_state(path)  # ...but nothing in it runs
    assert not sentinel.exists()


def test_pickled_object_where_tensors_belong(tmp_path: Path) -> None:
    path = write_state(tmp_path / "ck", make_state(), step=1)
    sentinel = tmp_path / "pwned"
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    payload = evil_pickle(sentinel)
    # Same length so DCP's offsets still point into the file; only the bytes are hostile.
    shard.write_bytes(payload + b"\0" * (size - len(payload)))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_state(path)
    forge_manifest_entry(path, "__0_0.distcp")
    with pytest.raises(CheckpointError, match="tensor data unreadable"):
        read_state(path)
    assert not sentinel.exists()


def test_cli_exit_codes_and_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    write_state(root / "step-1", make_state(5), step=1)
    s = make_state(5)
    s["model"]["layer.weight"][0, 0] += 1
    write_state(root / "step-2", s, step=2)

    def cli(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = cli("diff", str(root / "step-1"), str(root / "step-2"))
    assert code == 1 and out.startswith("state.model.layer.weight: 1 of 128 elements differ")
    assert cli("diff", str(root / "step-1"), str(root / "step-1"))[0] == 0
    assert cli("verify", str(root))[0] == 0
    code, out, _ = cli("inspect", str(root), "--step", "2")
    assert code == 0 and "model.layer.weight: float32 [8, 16] 512 bytes" in out
    assert "data.samples_seen = 1239" in out
    (root / "step-1" / "__0_0.distcp").write_bytes(b"junk")
    code, out, _ = cli("verify", str(root))
    assert code == 1 and "step-1/__0_0.distcp: size 4" in out
    code, out, _ = cli("ls", str(root))
    assert code == 0 and "step-2" in out
    assert cli("inspect", str(root))[0] == 2  # a root needs --step
    # As a real command: errors are one line, exit 2, no traceback.
    r = subprocess.run(
        [sys.executable, "-m", "checkpointing.cli", "diff", str(root / "nope"), str(root / "step-2")],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
