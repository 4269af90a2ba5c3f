"""The one error of every lifecycle's transition table: the supervisor's, the agent's, a checkpoint save's.

Each lifecycle is an enum with a table of the moves it allows (``rank/lifecycle.py``, ``agent/state.py``,
``checkpointing/lifecycle.py``); a move the table does not allow is a bug of the runtime, raised as this.
"""

from __future__ import annotations

__all__ = ["IllegalTransition"]


class IllegalTransition(RuntimeError):
    """A lifecycle was asked for a move its transition table does not allow."""
