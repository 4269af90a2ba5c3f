"""Retention: which committed checkpoints to delete, and deleting them off the training thread.

Keep the newest ``keep_last`` and every step divisible by ``keep_every``; never
the newest valid one. Only directories whose manifest is valid count (a broken
one is left for people to look at, and does not push a good one out).
``.tmp`` leftovers older than the newest committed step are removed.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

from checkpointing.catalog import list_steps
from checkpointing.commit import TMP_SUFFIX
from checkpointing.durable import remove_tree
from checkpointing.manifest import CheckpointError, Manifest

__all__ = ["RetentionWorker", "remove_leftovers", "select_deletions"]


def select_deletions(valid_steps: list[int], *, keep_last: int, keep_every: int) -> list[int]:
    """The steps to delete out of ``valid_steps`` (all with valid manifests)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ordered = sorted(set(valid_steps))
    keep = set(ordered[-keep_last:])
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in keep]


def remove_leftovers(root: Path) -> list[str]:
    """What crashed saves and deletions left (``step-N.tmp``, ``step-N.deleting``), removed when a job starts;
    returns their names. ``step-N.replaced`` is an older commit of step N moved aside just before the new
    one was renamed into place: without a ``step-N`` it is the only copy, and is put back."""
    removed = []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        name = child.name
        if not name.startswith("step-") or child.is_symlink() or not child.is_dir():
            continue
        if name.endswith(".replaced"):
            original = child.with_name(name[: -len(".replaced")])
            if not original.exists():
                os.rename(child, original)
                continue
        elif not name.endswith((TMP_SUFFIX, ".deleting")):
            continue
        remove_tree(child)
        removed.append(name)
    return removed


class RetentionWorker:
    """A named thread that applies retention to ``root`` whenever asked; ``close()`` joins it."""

    def __init__(self, root: Path, *, keep_last: int, keep_every: int, name: str = "ckpt-retention") -> None:
        self._root = Path(root)
        self._keep_last = keep_last
        self._keep_every = keep_every
        self._queue: queue.Queue[object] = queue.Queue()
        self.deleted: list[int] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._queue.put(True)

    def close(self, timeout: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "retention thread did not stop"

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self.apply_once()
            except OSError as e:  # log and keep going: retention must never stop training
                self.errors.append(str(e))

    def apply_once(self) -> list[int]:
        valid = []
        for entry in list_steps(self._root):
            try:
                if Manifest.read(entry.path).step == entry.step:
                    valid.append(entry.step)
            except CheckpointError:
                continue
        doomed = select_deletions(valid, keep_last=self._keep_last, keep_every=self._keep_every)
        for step in doomed:
            path = self._root / f"step-{step}"
            # Renamed first so a crash mid-delete never leaves a step-N with files missing.
            trash = path.with_name(path.name + ".deleting")
            os.rename(path, trash)
            remove_tree(trash)
            self.deleted.append(step)
        newest = max(valid, default=None)
        for child in self._root.iterdir():
            if child.name.endswith(".deleting"):
                remove_tree(child)
            elif newest is not None and child.name.startswith("step-") and child.name.endswith(TMP_SUFFIX):
                stem = child.name[len("step-") : -len(TMP_SUFFIX)]
                if stem.isdigit() and int(stem) < newest:
                    remove_tree(child)
        return doomed
