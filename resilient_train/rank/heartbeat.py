"""``resilient_train.rank.heartbeat()``: hang detection for a plain torchrun script, in one line.

Under ``resilient-train run`` the agent watches for hangs only the ranks that
report progress. The Supervisor reports by itself; a script that does not use
it calls ``heartbeat()`` once a step::

    import resilient_train as rt

    for step in range(start, steps):
        rt.heartbeat(step)
        ...

From its first heartbeat on, a rank that goes longer than its timeout without
one (computed from the intervals seen, ``monitors.HangConfig``) has its stacks
dumped and is killed, and the job restarts as torchrun's would. Before a long
pause that is not a hang, name it: ``heartbeat(step, section="checkpoint")``
(or ``"load"``) gets the long-section timeout. Outside the agent (plain
torchrun, a single process) it does nothing.
"""

from __future__ import annotations

import atexit
import os

from monitors.progress import ProgressReporter
from monitors.sections import SECTIONS
from resilient_train.protocol import env as E

__all__ = ["heartbeat"]

_reporter: ProgressReporter | None = None
_off = False
_count = 0


def heartbeat(step: int | None = None, *, section: str = "between-steps") -> None:
    """Marks progress of this rank: ``step`` (default: one more than the last call) is under way."""
    global _reporter, _off, _count
    if section not in SECTIONS:
        raise ValueError(f"heartbeat: unknown section {section!r}; expected one of {list(SECTIONS)}")
    if _off:
        return
    if _reporter is None:
        run_dir, rank = os.environ.get(E.RT_RUN_DIR), os.environ.get(E.RANK)
        if os.environ.get(E.RT_AGENT) != "1" or not run_dir or rank is None:
            _off = True  # not under the agent: nobody watches
            return
        _reporter = ProgressReporter(run_dir, int(rank))
        atexit.register(_reporter.close)  # a finished rank is not a hung one
    _count = _count + 1 if step is None else int(step)
    _reporter.enter(section, _count)
