"""Fixtures of the runtime's in-process tests."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest
import torch.distributed as dist


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
