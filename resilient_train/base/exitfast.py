"""Leave without the interpreter's last full garbage collections.

A process that imported torch spends 0.4 to 0.65 s at exit in the collections
the interpreter runs while it tears its modules down, walking every object the
imports made (measured on 2 cores: 0.65 s with torch.distributed.checkpoint
loaded, 0.11 s with this). The agent waits for that in every worker before it
can say the job ended, and the user waits for it in the agent.
``gc.freeze()`` at exit moves those objects out of the collector's reach:
atexit handlers and module teardown still run, files are still flushed by
reference counting; only objects held in reference cycles at exit are not
finalized, which Python never promises at exit anyway.
"""

from __future__ import annotations

import atexit
import gc

__all__ = ["skip_final_collection"]

_registered = False


def skip_final_collection() -> None:
    """Freezes the heap at exit (once per process, whoever asks)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(gc.freeze)
