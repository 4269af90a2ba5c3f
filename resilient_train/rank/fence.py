"""A rank's side of fencing: the ranks of a node declared lost leave before they can take part or write again.

A node is declared lost when its agent stops beating (resilient_train.protocol.nodes).
That happens when its host dies, and its ranks with it; but also when only
the agent stops (SIGSTOP, a debugger, a host frozen and thawed) while its
ranks run on, still reachable by their gloo peers. Replacing such a node
without fencing it puts two processes of one rank in the job. So the agent
that claims the loss sets ``NodeKeys.lost(node, incarnation)`` (its claim)
*before* it fails the generation, and every rank of a many-node job, which
knows its node and its agent's incarnation (``RT_NODE``,
``RT_NODE_INCARNATION``), looks at that key:

* when its watcher is woken (resilient_train.rank.watch): the claim's next move
  fails the generation, which wakes every rank at once, so a live rank of the
  lost node learns it within a round trip, whatever its main thread is doing;
* when it joins a generation (resilient_train.rank.rendezvous): no fenced rank
  writes a membership, so none is ever part of a later generation;
* before it writes a checkpoint (resilient_train.rank.disk).

A rank that loses the store (its judgement of a fault needs it, and it is
gone or past its deadline) cannot read that key: on a node other than 0 it
must assume it was set, since its node may be the one cut off, already
replaced (:func:`leave_if_cut_off`). Node 0's ranks stay: the store lives in
their own agent, whose failure is the job's (exit 1).

A fenced rank records the event, acknowledges its fence
(``NodeKeys.fenced(node, incarnation, rank)``) and exits
:data:`~resilient_train.base.exitcodes.FENCED` at once: no collective, no write, no
atexit handler (its checkpoint writer dies with it, PR_SET_PDEATHSIG). The
agent that takes the node over (a spare, or the node's next agent) starts
the replacements only once every rank of the lost incarnation acknowledged,
or after :data:`~resilient_train.protocol.nodes.FENCE_WAIT_S` (a rank that cannot answer is gone with its host,
or frozen: then it learns of the fence the moment it runs again), and not
before a node that is only cut off has fenced itself: its agent's store
calls run past their deadline, and it kills its ranks
(resilient_train.agent.membership.fence_wait_s). A job of one node has
nothing to fence: every check is a no-op.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from monitors import EventLog
from resilient_train.protocol import env as E
from resilient_train.base import exitcodes
from resilient_train.protocol.nodes import NodeKeys

__all__ = ["Fence", "check_fence", "leave_fenced", "leave_if_cut_off"]


@dataclass(frozen=True)
class Fence:
    """This rank's node and its agent's incarnation of it."""

    rank: int
    node: int
    incarnation: int
    run_dir: str | None

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "Fence | None":
        env = os.environ if environ is None else environ
        if not env.get(E.RT_NODE_INCARNATION):
            return None  # one node, or no agent: nothing to fence
        return cls(rank=int(env.get(E.RANK, "0")), node=int(env[E.RT_NODE]),
                   incarnation=int(env[E.RT_NODE_INCARNATION]), run_dir=env.get(E.RT_RUN_DIR) or None)

    def fenced(self, store: dist.Store) -> bool:
        return bool(store.check([NodeKeys.lost(self.node, self.incarnation)]))

    def check(self, store: dist.Store, where: str) -> None:
        """Leaves (exit FENCED) if this rank's node was declared lost."""
        if self.fenced(store):
            self.leave(store, where)

    def leave(self, store: dist.Store, where: str, *, say: bool = True, ack: bool = True) -> NoReturn:
        """Records the fence, says so on stderr (``say``), acknowledges it (``ack``: not to a store that is gone,
        whose calls may block for ever), and exits FENCED at once."""
        if self.run_dir is not None:
            try:
                EventLog(Path(self.run_dir) / "events.jsonl", source=f"rank{self.rank}").emit(
                    "fenced", rank=self.rank, pid=os.getpid(), node=self.node, incarnation=self.incarnation,
                    where=where)
            except OSError:
                pass
        line = (f"[rank{self.rank}] resilient-train: node {self.node} was declared lost (its agent stopped "
                f"beating): this rank leaves ({where}; exit code {exitcodes.FENCED})\n")
        try:  # never blocking: the agent that reads this pipe may be the one that stopped, with the pipe full
            if say:
                fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_NONBLOCK)
                os.write(2, line.encode())
        except OSError:
            pass
        try:
            if ack:
                store.set(NodeKeys.fenced(self.node, self.incarnation, self.rank), str(time.time()))
        except Exception:  # noqa: BLE001  (the store went: the fence still holds, nothing more to tell)
            pass
        os._exit(exitcodes.FENCED)


_FENCE: list[Fence | None] = []  # read from the environment once per process


def _fence() -> Fence | None:
    if not _FENCE:
        _FENCE.append(Fence.from_environ())
    return _FENCE[0]


def check_fence(store: dist.Store, where: str) -> None:
    """:meth:`Fence.check` for this process's rank (a no-op outside a many-node job)."""
    fence = _fence()
    if fence is not None:
        fence.check(store, where)


def leave_if_cut_off(store: dist.Store) -> None:
    """This rank lost the store: on a node other than 0 of a many-node job it leaves as fenced (no write, no
    collective, exit FENCED), silently (its agent's line says it for the node); elsewhere it returns."""
    fence = _fence()
    if fence is not None and fence.node != 0:
        fence.leave(store, "store lost", say=False, ack=False)


def leave_fenced(store: dist.Store, where: str) -> NoReturn:
    """This rank cannot know whether its node is still part of the job: it leaves as fenced, silently (its
    agent's line says it for the node), whatever its node; without a fence (one node) it exits FENCED too."""
    fence = _fence()
    if fence is not None:
        fence.leave(store, where, say=False, ack=False)
    os._exit(exitcodes.FENCED)
