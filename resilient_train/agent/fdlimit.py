"""The store host's open-file limit.

Node 0's agent serves every connection to the job's store from its own
process: a rank holds up to :data:`CONNECTIONS_PER_RANK` (its supervisor's,
its join's, its heartbeat's, its checkpoint coordinator's), so 4,096 ranks
need about 16,000 descriptors, far past the usual soft limit of 1,024. A
server past its limit refuses the next connection, and the rank that made it
fails as if node 0 were gone. So the hosting agent raises its soft limit to
the hard one, and says so in one line when even the hard limit is too low.

Its children (workers, spares) get the limit the agent was started with,
as under torchrun, which changes none: :func:`restore_in_child` runs in each
child before its exec.
"""

from __future__ import annotations

import resource
from pathlib import Path

__all__ = ["CONNECTIONS_PER_RANK", "raise_for_store", "restore_in_child"]

CONNECTIONS_PER_RANK = 4
MARGIN = 256  # the agent's own files, sockets and pipes, the other nodes' agents

_started_with: tuple[int, int] | None = None  # the limit before raise_for_store, for the children


def raise_for_store(world_size: int) -> str | None:
    """Raises this process's soft ``RLIMIT_NOFILE`` to its hard limit; a warning line if that is still short
    of what ``world_size`` ranks may open (None when it is enough)."""
    global _started_with
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _started_with is None:
        _started_with = (soft, hard)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # the soft limit stays where it was; the check below says whether that is enough
    need = CONNECTIONS_PER_RANK * world_size + MARGIN
    if soft != resource.RLIM_INFINITY and soft < need:
        return (f"warning: the store host may hold {need} open files ({CONNECTIONS_PER_RANK} "
                f"connections per rank for {world_size} ranks) but its limit is {soft}; raise it "
                f"(ulimit -n {need}, or LimitNOFILE= in the service) or ranks will fail to reach the store")
    return None


def _nr_open() -> int:
    """The kernel's ceiling on a process's descriptors (an unlimited hard limit cannot be set as the soft one)."""
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


def restore_in_child() -> None:
    """In a child before its exec: the limit the agent started with (a no-op when it was never raised)."""
    if _started_with is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, _started_with)
        except (ValueError, OSError):
            pass
