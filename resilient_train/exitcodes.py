"""The exit codes of ranks and of the agent: the table lives in :mod:`monitors.exitcodes`, which the lower
packages (``checkpointing``, ``chaos``) read too."""

from __future__ import annotations

from monitors.exitcodes import (BAD_INPUT, DISK_FULL, FAILED, FENCED, OK, REQUEUE, RERUN_ELSEWHERE,
                                STOPPED, STORAGE, VALIDATION_FAILED)

__all__ = ["BAD_INPUT", "DISK_FULL", "FAILED", "FENCED", "OK", "REQUEUE", "RERUN_ELSEWHERE", "STOPPED", "STORAGE",
           "VALIDATION_FAILED"]
