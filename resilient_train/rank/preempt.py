"""Preemption: a signal becomes a checkpoint at a step boundary every rank agrees on.

A scheduler that takes the nodes back sends SIGTERM (Slurm's ``--signal``
sends SIGUSR1 ahead of time) to the agents, or to the ranks themselves. A rank
that sees one only raises its stop flag, which rides with the commit vote of
the step under way (resilient_train.rank.reducer: a second summed slot). Every rank
reads the same sum after the same step, so all of them stop at the same
boundary: a synchronous committed checkpoint of that boundary is written, and
each rank exits with :data:`~resilient_train.base.exitcodes.REQUEUE`; the agents
exit with it too. Started again, the job resumes from that checkpoint and
loses no step.

The grace (``grace_s``) is counted from the signal, or from the step whose vote
told this rank, to the rank's exit: the save in flight, the preemption's own
save and the exit all fit in it, and the agents SIGKILL what is left at its end
(resilient_train.protocol.shutdown: the ranks publish it, the agents follow it). Unset,
it is :data:`~resilient_train.protocol.shutdown.DEFAULT_GRACE_S`, grown to cover three
times the longest save the job has made (two saves and slack). If the checkpoint is not committed in time
the rank exits with the same code anyway (the job then resumes from its
previous checkpoint); ``on_grace_expiry="wait"`` gives the save the
checkpoint's own ``timeout_s`` more, for schedulers whose grace is known to be
longer.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from resilient_train.base import exitcodes
from resilient_train.protocol.shutdown import EXIT_RESERVE_S, auto_grace, check_seconds, publish_grace, record_preempted

if TYPE_CHECKING:
    import torch.distributed as dist

    from monitors.events import EventLog
    from resilient_train.rank.disk import DiskCheckpoints
    from resilient_train.rank.train_state import TrainState

__all__ = ["Preemption", "PreemptionConfig", "checkpoint_for_preemption"]

_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP", "SIGQUIT")
# A preempted rank waits this long for a join under way (a replacement from a warm spare joins within a second,
# a cold one within a few) before it stops the job from the join (Preemption.overdue_in_join).
JOIN_WAIT_S = 5.0
# SIGUSR2 is the agent's request for a hung rank's stacks (monitors.stacks): a preemption on it would turn
# every hang report into a stop of the job.
_RESERVED = {"SIGUSR2": "the agent asks a hung rank for its stacks with it (monitors.stacks)"}


@dataclass(frozen=True, kw_only=True)
class PreemptionConfig:
    # Each one asks for a stop at the next boundary: Ctrl-C, a closed terminal (SIGHUP) and Ctrl-\ (SIGQUIT) too,
    # which the agent forwards: every one stops the job cleanly, checkpointed.
    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP", "SIGQUIT")
    grace_s: float | None = None  # from the signal to the rank's exit; None: 60 s, or 3x the longest save
    on_grace_expiry: str = "exit"  # "exit": leave without the checkpoint; "wait": its timeout_s more for the save

    def __post_init__(self) -> None:
        reserved = [s for s in self.signals if s in _RESERVED]
        if reserved:
            raise ValueError(f"preemption.signals: {reserved[0]} cannot preempt: {_RESERVED[reserved[0]]}")
        bad = [s for s in self.signals if s not in _SIGNALS]
        if bad:
            raise ValueError(f"preemption.signals: unknown signal {bad[0]!r} (one of {', '.join(_SIGNALS)})")
        if self.grace_s is not None:
            check_seconds(self.grace_s, "preemption.grace_s")
            if self.grace_s <= EXIT_RESERVE_S:
                raise ValueError(f"preemption.grace_s must be more than {EXIT_RESERVE_S:g} s (a rank's exit), "
                                 f"got {self.grace_s!r}")
        if self.on_grace_expiry not in ("exit", "wait"):
            raise ValueError(f"preemption.on_grace_expiry must be 'exit' or 'wait', got {self.on_grace_expiry!r}")


class Preemption:
    """This rank's stop flag: raised by a signal (or by :meth:`request`), read into the vote."""

    def __init__(self, config: PreemptionConfig) -> None:
        self.config = config
        self.signal: str | None = None  # the first one received
        self.requested_at: float | None = None  # when (monotonic)
        self._published: float | None = None  # the grace in the store for this rank's agent
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for name in config.signals:
                signum = getattr(signal, name)
                self._previous[signum] = signal.signal(signum, self._on_signal)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def overdue_in_join(self, *, since: float) -> bool:
        """Requested, and the join that began at ``since`` (monotonic) is still under way :data:`JOIN_WAIT_S`
        after the signal or after it began, whichever came later: no boundary every rank shares is coming soon
        (a peer that will not come back: under plain torchrun a dead one), so the job stops now, without the
        checkpoint, rather than be killed at the launcher's timeout. A signal that came during a long step
        still gives the join that follows its own wait."""
        return (self.requested_at is not None
                and time.monotonic() - max(self.requested_at, since) >= JOIN_WAIT_S)

    def request(self, why: str) -> None:
        if self.signal is None:
            self.requested_at = time.monotonic()
            self.signal = why

    def grace_s(self, longest_save_s: float, checkpoint_timeout_s: float) -> float:
        """This rank's grace now, from the signal to its exit (what it publishes for its agent)."""
        grace = self.config.grace_s if self.config.grace_s is not None else auto_grace(longest_save_s)
        return grace + (checkpoint_timeout_s if self.config.on_grace_expiry == "wait" else 0.0)

    def publish_grace(self, store: "dist.Store", rank: int, longest_save_s: float,
                      checkpoint_timeout_s: float) -> float:
        """This rank's grace now (:meth:`grace_s`), in the store for its agent whenever it changes."""
        grace = self.grace_s(longest_save_s, checkpoint_timeout_s)
        if grace != self._published:
            publish_grace(store, rank, grace)
            self._published = grace
        return grace

    def deadline(self, grace_s: float) -> float:
        """When the checkpoint must be committed by (monotonic): the grace from the signal, less the exit's share.

        A rank told by the vote (the signal reached another rank) counts from now."""
        start = self.requested_at if self.requested_at is not None else time.monotonic()
        return start + grace_s - EXIT_RESERVE_S

    def flag(self) -> float:
        """The stop slot of this rank's vote."""
        return 1.0 if self.signal is not None else 0.0

    def _on_signal(self, signum: int, frame: object) -> None:
        self.request(signal.Signals(signum).name)
        _quiet_dataloader_sigchld()

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def _quiet_dataloader_sigchld() -> None:
    """A stop signal sent to the whole job reaches the DataLoader's workers too, and SIGTERM kills them (torch
    gives them a handler that re-raises it). torch's SIGCHLD handler in the rank then raises their death as an
    error wherever the main thread happens to be, in the runtime's own recovery too. The job is stopping: that
    handler goes (SIGCHLD's default, ignored), and the loader reports its dead workers where the step reads
    from it, as a failed step that the stop makes the last one (the ranks agree to stop at their boundary)."""
    handler = signal.getsignal(signal.SIGCHLD)
    if callable(handler) and getattr(handler, "__module__", "").startswith("torch.utils.data"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def checkpoint_for_preemption(state: "TrainState", *, preemption: Preemption, grace: float, rank: int,
                              store: "dist.Store", events: "EventLog", enter: Callable[[str, int], None],
                              disk: Callable[[], "DiskCheckpoints"], prepare: bool, generation: int,
                              under_agent: bool) -> bool:
    """Every rank is at this boundary: its checkpoint, committed within ``grace``; True once committed.

    ``disk``: the checkpoints to save to (made for the preemption if the run has none); ``prepare``: no disk
    part of the loop has readied them for this generation.
    """
    deadline = preemption.deadline(grace)
    events.emit("preempting", rank=rank, step=state.step, signal=preemption.signal, grace_s=grace)
    record_preempted(store, rank, step=state.step, committed=None)
    enter("checkpoint", state.step)
    checkpoints = disk()
    if prepare:
        checkpoints.on_generation(store, generation)  # a DiskPart would have done both
        checkpoints.prepare(state)
    committed = checkpoints.save_now(state, deadline=deadline, exit_by=deadline + EXIT_RESERVE_S)
    record_preempted(store, rank, step=state.step, committed=committed)
    events.emit("preempted", rank=rank, step=state.step, checkpoint_committed=committed, signal=preemption.signal)
    if rank == 0 and not under_agent:  # the agent says it once for its node
        how = "its checkpoint is committed" if committed else f"its checkpoint did not commit within {grace:g} s"
        print(f"resilient-train: preempted: every rank stopped at step {state.step}; {how}; "
              f"start the job again to resume (exit code {exitcodes.REQUEUE})", file=sys.stderr, flush=True)
    return committed
