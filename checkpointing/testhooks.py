"""Crash points and slow writes for tests: a save dies, or takes its time, at a named stage.

Set ``RESILIENT_TRAIN_CKPT_KILL_AT`` to ``STAGE``, ``STAGE@STEP`` or
``STAGE@STEP@RANK`` in the environment of a rank (the background writer inherits
it): the process SIGKILLs itself there. Set ``RESILIENT_TRAIN_CKPT_SLOW_WRITE``
to ``SECONDS@STEP`` or ``SECONDS@STEP@RANK``: the writer process sleeps that long
before it writes the step (a save in flight that outlasts a preemption's
timeout, without a large state). Unset, each is a dictionary lookup and nothing else.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["KILL_AT_ENV", "SLOW_WRITE_ENV", "STAGES", "crash_point", "slow_write"]

KILL_AT_ENV = "RESILIENT_TRAIN_CKPT_KILL_AT"
SLOW_WRITE_ENV = "RESILIENT_TRAIN_CKPT_SLOW_WRITE"

# In the order a save goes through them.
STAGES = (
    "staging",  # rank: half of the tensors copied into the host buffers
    "staged",  # rank: staging done, nothing handed to the writer yet
    "writing",  # writer process: the shard file is partly written
    "written",  # writer process: shard and metadata piece written and fsync'd, not reported
    "reported",  # rank: its shard is durable and announced in the store
    "metadata",  # rank 0: global .metadata written, no manifest yet
    "manifest",  # rank 0: manifest written into step-N.tmp, not renamed
    "renamed",  # rank 0: step-N.tmp renamed to step-N, `latest` not updated
    "latest",  # rank 0: `latest` updated, nothing announced to the other ranks
)


def crash_point(stage: str, *, step: int, rank: int) -> None:
    spec = os.environ.get(KILL_AT_ENV)
    if not spec:
        return
    assert stage in STAGES, stage
    parts = spec.split("@")
    if parts[0] != stage:
        return
    if len(parts) > 1 and int(parts[1]) != step:
        return
    if len(parts) > 2 and int(parts[2]) != rank:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def slow_write(*, step: int, rank: int) -> None:
    """In the writer process, before it writes ``step``: sleeps as ``RESILIENT_TRAIN_CKPT_SLOW_WRITE`` says."""
    spec = os.environ.get(SLOW_WRITE_ENV)
    if not spec:
        return
    parts = spec.split("@")
    if len(parts) > 1 and int(parts[1]) != step:
        return
    if len(parts) > 2 and int(parts[2]) != rank:
        return
    time.sleep(float(parts[0]))
