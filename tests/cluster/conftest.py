from __future__ import annotations

from typing import Iterator

import pytest
from slurmcluster import SlurmCluster, SlurmUnavailable, unavailable_reason


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """One Slurm cluster of 3 nodes for the session's tests (its start costs seconds; tests wait on their own
    jobs' states, so they share it)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        cluster = SlurmCluster(nodes=3).start()
    except SlurmUnavailable as e:
        pytest.skip(f"Slurm's daemons do not start on this machine: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
