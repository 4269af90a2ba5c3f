"""What went wrong in a rank, and whether it is a fault to recover or a bug to stop on.

Recovered: collective and store errors, a generation another party declared
failed, dead or hung peers (they surface as the first two), injected faults,
and an exception that does not happen again when its step is replayed once.
Stopped on: an exception that reproduces on its replay (a bug), and a misuse
of the runtime (:class:`UsageError`). Retrying a bug only hides it behind
rollbacks; torchft votes on errors, NVRx stops after cycles without progress.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "FailureKind",
    "Failure",
    "GenerationFailed",
    "JobStopped",
    "UsageError",
    "WrongInput",
    "classify",
]


class GenerationFailed(RuntimeError):
    """The current generation was declared failed (by a peer, the agent, or this rank)."""


class UsageError(ValueError):
    """The runtime is used in a way it cannot work with: the job stops with this one line."""


class WrongInput(UsageError):
    """The job's own input contradicts itself, found once the ranks run (a ``steps`` below the step of the
    checkpoint it resumes from): the job stops with this one line and exit code 2, as a bad flag does."""


class JobStopped(Exception):
    """Another rank stopped the job (a bug or a misuse): this rank leaves quietly."""

    def __init__(self, reason: str, exit_code: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


class FailureKind(str, Enum):
    FAULT = "fault"  # a collective/store error or a failed generation: recover
    EXCEPTION = "exception"  # raised by the step itself: recover once, stop if the replay raises it again
    USAGE = "usage"  # a misuse of the runtime: stop at once


@dataclass(frozen=True, kw_only=True)
class Failure:
    kind: FailureKind
    signature: str  # equal for "the same error": type, message without numbers, innermost frame
    summary: str  # one line for people

    def to_dict(self) -> dict[str, str]:
        return {"failure": self.kind.value, "signature": self.signature, "summary": self.summary}


# Messages of the errors a dead, hung or unreachable peer causes (gloo, NCCL, TCPStore).
_COLLECTIVE = re.compile(
    r"connection (closed|reset|refused)|broken pipe|timed out|\btimeout\b|\bsocket\b|\bgloo\b|\bnccl\b|"
    r"processgroup|process group|\bstore\b|by peer|\baborted\b|communicator", re.IGNORECASE,
)


def _is_collective(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, (GenerationFailed, TimeoutError, ConnectionError)):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return type(exc) is RuntimeError and bool(_COLLECTIVE.search(str(exc)))


def _signature(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    # Addresses, ports, pids and step numbers change from one attempt to the next.
    message = re.sub(r"\d+", "N", str(exc))[:200]
    return f"{type(exc).__qualname__}: {message} @ {where}"


def classify(exc: BaseException) -> Failure:
    summary = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()[:300]
    if isinstance(exc, UsageError):
        kind = FailureKind.USAGE
    elif _is_collective(exc):
        kind = FailureKind.FAULT
    else:
        kind = FailureKind.EXCEPTION
    return Failure(kind=kind, signature=_signature(exc), summary=summary)
