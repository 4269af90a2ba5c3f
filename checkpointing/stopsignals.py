"""The signals that ask a job to stop, and how a helper process of a rank leaves them to its rank.

Ctrl-C (SIGINT to the foreground process group), GNU ``timeout`` and ``kill
-TERM -PGID`` (SIGTERM to the group), a closed terminal (SIGHUP), Ctrl-\\
(SIGQUIT) and Slurm's ``--signal`` (SIGUSR1 to every process of the step)
reach every process of a job, not only its ranks. A rank turns them into a
checkpointed stop (resilient_train.rank.preempt); its helpers (the checkpoint
writer, a warm spare still waiting) must not die of them meanwhile: the
writer's save is exactly what the stop needs. They ignore them, and end by
their rank's decision or with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import signal

__all__ = ["STOP_SIGNALS", "ignore_stop_signals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def ignore_stop_signals() -> None:
    """In a child before its exec: :data:`STOP_SIGNALS` ignored (an ignored signal stays ignored across exec).

    libc's ``signal`` only: between fork and exec nothing else is safe."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    for signum in STOP_SIGNALS:
        libc.signal(int(signum), 1)  # SIG_IGN
