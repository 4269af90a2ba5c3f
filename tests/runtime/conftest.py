"""Fixtures of the runtime's in-process tests."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest
import torch.distributed as dist

if TYPE_CHECKING:
    from heart_rig import Rig


@pytest.fixture
def gloo_one(tmp_path: Path) -> Iterator[dist.Store]:
    """A real gloo group of one (the default group) on a FileStore in ``tmp_path``: what a world of one builds.
    Yields the store (the group's keys live under a prefix of their own)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield store
    finally:
        dist.destroy_process_group()


@pytest.fixture
def rig(gloo_one: dist.Store, tmp_path: Path) -> "Rig":
    """A stepper at boundary 0 over a small model, on the group of one (tests/runtime/heart_rig.py)."""
    from heart_rig import Rig

    return Rig(gloo_one, tmp_path)
