"""The run directory under the job: still there, still the same, still writable.

Every party writes there: the ranks their progress slots, events, checkpoints
and the final state; the agent its monitor state. A directory removed (or
replaced by another one at the same path) or a filesystem remounted read-only
while the job runs is not cured by any replacement: once a second the agent
looks (one ``stat`` and one ``statvfs``) and, at the first sign, the job stops
with :data:`~resilient_train.base.exitcodes.STORAGE` (74) and one line saying what
it found. A full disk is found by the write that fails (exit 28).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from resilient_train.agent.events import RunDirFailed

__all__ = ["RunDirWatch"]

_EVERY_S = 1.0


class RunDirWatch:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        st = os.stat(run_dir)
        self._identity = (st.st_dev, st.st_ino)
        self._looked_at = time.monotonic()
        self._reported = False

    def poll(self) -> list[RunDirFailed]:
        now = time.monotonic()
        if self._reported or now - self._looked_at < _EVERY_S:
            return []
        self._looked_at = now
        reason = self._problem()
        if reason is None:
            return []
        self._reported = True
        return [RunDirFailed(reason=reason)]

    def _problem(self) -> str | None:
        where = f"the run directory {self.run_dir}"
        try:
            st = os.stat(self.run_dir)
        except FileNotFoundError:
            return f"{where} was removed while the job ran: nothing can be written (checkpoints, events, the final state)"
        except OSError as e:
            return f"{where} cannot be read: {e.strerror or e}"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"{where} was replaced by another directory while the job ran: its files are gone from under it"
        try:
            read_only = bool(os.statvfs(self.run_dir).f_flag & os.ST_RDONLY)
        except OSError as e:
            return f"{where} cannot be read: {e.strerror or e}"
        if read_only:
            return f"the filesystem of {where} became read-only: no checkpoint, event or final state can be written"
        return None
