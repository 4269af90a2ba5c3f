from __future__ import annotations

from typing import Iterator

import pytest
from monhelp import Procs


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    try:
        yield ps
    finally:
        ps.close()
