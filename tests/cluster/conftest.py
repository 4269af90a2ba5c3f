from __future__ import annotations

from typing import Iterator

import pytest
from cluster.netns import Network, unavailable
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


@pytest.fixture
def network():
    """Nodes with addresses of their own (cluster.netns): ``network(n)`` makes n; each is closed at the end,
    every process of every node first (a test that failed leaves its agents running)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    made: list[Network] = []

    def make(nodes: int) -> Network:
        made.append(Network(nodes))
        return made[-1]

    yield make
    for net in made:
        net.close()
