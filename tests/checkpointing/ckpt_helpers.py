"""Shared helpers for the checkpointing tests: states, and forging files as an attacker would."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from checkpointing.durable import file_sha256
from checkpointing.manifest import FileEntry, Manifest


def make_state(seed: int = 0, *, scale: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "layer.weight": torch.randn(8 * scale, 16, generator=g),
            "bias": torch.randn(16, generator=g).to(torch.bfloat16),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(8 * scale, 16, generator=g)}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}],
        },
        "rng": torch.randint(0, 255, (64,), generator=g, dtype=torch.uint8),
        "data": {"samples_seen": 1234 + seed, "epoch": 0, "name": "shard-a", "loss": float("nan"), "extra": None},
    }


def forge_manifest_entry(directory: Path, name: str) -> None:
    """Makes the manifest vouch for the current bytes of ``name`` (an attacker with write access)."""
    m = Manifest.read(directory)
    size, digest = file_sha256(directory / name)
    m.files[name] = FileEntry(size=size, sha256=digest)
    m.write(directory)


class Evil:
    """Unpickling this creates ``path``: the sentinel that proves code ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def evil_pickle(sentinel: Path) -> bytes:
    return pickle.dumps(Evil(sentinel))


def rank_state(step: int, rank: int, *, scale: int = 1) -> dict[str, Any]:
    """What a data-parallel rank holds at ``step``: replicated model/optimizer/data, its own RNG."""
    state = make_state(step, scale=scale)
    state["rng"] = torch.randint(0, 255, (32,), generator=torch.Generator().manual_seed(1000 * step + rank), dtype=torch.uint8)
    return state
