"""Issue 17, item 6: a full disk is named as the cause, and checkpointing stops instead of failing forever.

A real full filesystem: a 256 KiB tmpfs mounted in a private user and mount namespace (``unshare``), so the
test needs no root and leaves nothing mounted. Step 1 fits, step 2 does not: every rank's save of step 2
fails naming the full disk, every later save raises DiskFullError, and a final state too large for the disk
fails with a DiskFullError naming the directory. (RLIMIT_FSIZE would give EFBIG, a different error; it is
covered in test_ckpt_crash and, correctly, is not called a full disk.)
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest

from checkpointing import EXIT_DISK_FULL, DiskFullError, is_disk_full
from oneline import in_private_mount, namespace_tool

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.mark.timeout(240)
@pytest.mark.skipif(namespace_tool() is None, reason="no unprivileged user+mount namespaces here (unshare)")
def test_a_full_disk_is_named_and_stops_checkpointing(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    r = in_private_mount(
        f"mount -t tmpfs -o size=256k tmpfs {disk}",
        [sys.executable, str(HERE / "disk_full_job.py"), "--dir", str(disk / "ck"), "--final", str(disk / "final"),
         "--events", str(tmp_path / "events.jsonl"), "--scales", "1,400,1"],
        env=env, timeout=200)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0, (r.stdout, r.stderr)
    by_rank = {rank: [x for x in lines if x["rank"] == rank] for rank in (0, 1)}
    for rank, got in by_rank.items():
        assert got[0]["phase"] == "committed", got
        assert got[1]["phase"] == "failed" and got[1]["disk_full"], got
        assert "disk full: no space left on the device holding" in got[1]["error"], got
        assert got[2]["raised"] == "DiskFullError" and "disk full" in got[2]["error"], got
        assert got[-1]["exit"] == 0 and "Traceback" not in got[-1]["stderr"]
    final = next(x for x in by_rank[0] if "final" in x)
    assert final["final"] == "DiskFullError" and final["disk_full"]
    assert f"{disk}/final.tmp" in final["error"] and "free" in final["error"], final
    # Rank 0 told the console once; the events name the cause.
    stderr0 = by_rank[0][-1]["stderr"].splitlines()
    assert sum("resilient-train: checkpoint step 2 failed: " in x for x in stderr0) == 1
    assert not by_rank[1][-1]["stderr"].strip()  # nothing else: waiting on rank 0's verdict logs nothing
    failed = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()
              if '"checkpoint_failed"' in x]
    assert {e["rank"] for e in failed} == {0, 1} and all(e["disk_full"] for e in failed)


@pytest.mark.timeout(30)
def test_is_disk_full_classifies_errors() -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.EFBIG, "File too large"))
    assert not is_disk_full(ValueError("x")) and not is_disk_full(None)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("the final write failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)  # through the cause
    assert is_disk_full(RuntimeError("rank 1: [Errno 28] No space left on device"))  # text from another process
    e = DiskFullError("disk full: no space left on the device holding /x")
    assert is_disk_full(e) and str(e) == "disk full: no space left on the device holding /x" and e.errno == errno.ENOSPC
    assert EXIT_DISK_FULL == 28
