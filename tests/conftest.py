from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jobs import Job, run_ddp, run_gpt  # noqa: E402


class References:
    """Fault-free runs, computed once per session and shared by the tests."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._jobs: dict[tuple[str, int, int], Job] = {}

    def get(self, nproc: int, steps: int, *, script: str = "gpt") -> Path:
        key = (script, nproc, steps)
        if key not in self._jobs:
            run = {"gpt": run_gpt, "ddp": run_ddp}[script]
            job = run(self.root / f"ref-{script}-{nproc}x{steps}", nproc=nproc, steps=steps)
            assert job.returncode == 0, job.stderr[-2000:]
            self._jobs[key] = job
        return self._jobs[key].run_dir / "final"


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("references"))
