from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jobs import Job, run_gpt  # noqa: E402


class References:
    """Fault-free runs, computed once per session and shared by the tests."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._jobs: dict[tuple[int, int], Job] = {}

    def get(self, nproc: int, steps: int) -> Path:
        key = (nproc, steps)
        if key not in self._jobs:
            job = run_gpt(self.root / f"ref-{nproc}x{steps}", nproc=nproc, steps=steps)
            assert job.returncode == 0, job.stderr[-2000:]
            self._jobs[key] = job
        return self._jobs[key].run_dir / "final"


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("references"))
