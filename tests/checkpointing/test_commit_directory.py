"""The atomic directory commit both checkpoint formats end in (checkpointing.commit.commit_directory).

A reader sees the old step directory or the complete new one: the manifest is
written and made durable inside ``step-N.tmp`` before the rename, and a step
saved again replaces the old directory without leaving it behind. Real files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointing.commit import commit_directory
from checkpointing.durable import file_sha256
from checkpointing.manifest import MANIFEST_FILE, FileEntry, Manifest, verify_checkpoint

pytestmark = pytest.mark.timeout(30)


def _tmp_with(root: Path, step: int, data: bytes) -> tuple[Path, Path, Manifest]:
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.tmp"
    tmp.mkdir(parents=True)
    (tmp / "shard.bin").write_bytes(data)
    size, digest = file_sha256(tmp / "shard.bin")
    manifest = Manifest(step=step, world_size=1, files={"shard.bin": FileEntry(size=size, sha256=digest)},
                        tree={"D": []}, run_id="run")
    return tmp, final, manifest


def test_the_manifest_is_durable_in_tmp_before_the_rename(tmp_path: Path) -> None:
    tmp, final, manifest = _tmp_with(tmp_path, 3, b"abc")
    stages: list[tuple[str, bool, bool]] = []
    commit_directory(tmp, final, manifest,
                     crash_point=lambda s: stages.append((s, (tmp / MANIFEST_FILE).is_file(), final.exists())))
    assert stages == [("manifest", True, False), ("renamed", False, True)]
    assert not tmp.exists()
    assert verify_checkpoint(final, run_id="run").step == 3


def test_a_step_saved_again_replaces_the_old_one_and_leaves_nothing_behind(tmp_path: Path) -> None:
    tmp, final, manifest = _tmp_with(tmp_path, 4, b"old")
    commit_directory(tmp, final, manifest)
    tmp, final, manifest = _tmp_with(tmp_path, 4, b"new bytes")
    commit_directory(tmp, final, manifest)
    assert (final / "shard.bin").read_bytes() == b"new bytes"
    verify_checkpoint(final, run_id="run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]
