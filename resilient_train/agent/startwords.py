"""What a torchrun user should know before the job starts, said once by the agent."""

from __future__ import annotations

from pathlib import Path

from resilient_train.agent.config import AgentConfig
from resilient_train.agent.entry import Entry

__all__ = ["start_lines"]


def start_lines(config: AgentConfig, entry: Entry, *, omp_default: bool, fd_warning: str | None) -> list[str]:
    lines = []
    if omp_default:
        lines.append("OMP_NUM_THREADS is set to 1 for each worker, as torchrun does (set it to tune)")
    if fd_warning is not None:
        lines.append(fd_warning)
    if config.monitor.hang.enabled and not entry.mentions_runtime():
        lines.append(f"hang detection is off for {Path(entry.target).name}: its ranks report no progress "
                     "(call resilient_train.rank.heartbeat() once a step to turn it on)")
    return lines
