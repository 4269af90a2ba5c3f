"""``resilient-train run``'s inputs, checked before any worker starts.

A bad ``--chaos`` list used to reach every worker, crash each of them and
spend the restart budget; a bad ``--monitor-config`` ended in a traceback. Here
each one is a ``ValueError`` whose message is one line naming the flag, which
the command line prints before exiting 2. The limits and their reasons:

* ranks per node: ``monitors.max_local_ranks()`` (4 per CPU core, at least 8);
* faults: ``chaos.faults.MAX_FAULTS`` and ``MAX_CHAOS_BYTES`` (they reach the
  workers in one environment variable, which Linux caps at 128 KiB);
* config files: ``monitors.configfile.MAX_CONFIG_BYTES`` and ``MAX_NESTING``, no
  YAML anchors or aliases.
"""

from __future__ import annotations

from chaos import parse_faults
from monitors import MonitorConfig, max_local_ranks

__all__ = ["check_run_inputs"]


def check_run_inputs(
    *, nproc_per_node: int, nnodes: int, chaos: str, monitor_config: str | None,
) -> MonitorConfig | None:
    """Checks ``run``'s flags; returns the monitor config read from ``monitor_config`` (None without one)."""
    limit = max_local_ranks()
    if nproc_per_node > limit:
        raise ValueError(f"--nproc-per-node {nproc_per_node}: at most {limit} ranks on this node (4 per CPU core: "
                         "more starve each other until the hang detector kills healthy ones)")
    if chaos:
        try:
            parse_faults(chaos, world_size=max(1, nproc_per_node) * max(1, nnodes))
        except ValueError as e:
            raise ValueError(f"--chaos: {e}") from None
    if monitor_config is None:
        return None
    try:
        return MonitorConfig.load(monitor_config)
    except ValueError as e:
        raise ValueError(f"--monitor-config: {e}") from None
