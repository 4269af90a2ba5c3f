"""``resilient-train run``'s inputs, checked before any worker starts.

A bad ``--chaos`` list used to reach every worker, crash each of them and
spend the restart budget; a bad ``--monitor-config`` ended in a traceback. Here
each one is a ``ValueError`` whose message is one line naming the flag, which
the command line prints before exiting 2. The limits and their reasons:

* ranks per node: ``monitors.max_local_ranks()`` (4 per CPU core, at least 8);
* faults: ``chaos.faults.MAX_FAULTS`` and ``MAX_CHAOS_BYTES`` (they reach the
  workers in one environment variable, which Linux caps at 128 KiB);
* config files: ``resilient_train.base.configfile.MAX_CONFIG_BYTES`` and ``MAX_NESTING``, no
  YAML anchors or aliases;
* ``--log-dir``: a directory this user can write (made private, ``0o700``,
  when it is created here: the workers' output can hold what the run
  directory keeps private).

Numbers, ports and hosts are checked while the flags are parsed
(``resilient_train.base.cliargs``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from chaos import parse_faults
from monitors import MonitorConfig, max_local_ranks

__all__ = ["check_log_dir", "check_run_inputs"]


def check_run_inputs(
    *, nproc_per_node: int, nnodes: int, chaos: str, monitor_config: str | None, log_dir: str | None = None,
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
    if log_dir is not None:
        check_log_dir(log_dir)
    if monitor_config is None:
        return None
    try:
        return MonitorConfig.load(monitor_config)
    except ValueError as e:
        raise ValueError(f"--monitor-config: {e}") from None


def check_log_dir(path: str) -> Path:
    """Creates ``path`` (``0o700``, parents too) if missing; ``ValueError`` unless it is a directory this user
    can write."""
    p = Path(path)
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(p)
    except OSError as e:
        raise ValueError(f"--log-dir {path!r}: cannot create it: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"--log-dir {path!r}: not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"--log-dir {path!r}: not writable by this user")
    return p
