"""The agents of a many-node job: who serves which node, which node is lost, which spare takes it.

One agent runs per node (``--nnodes N --node-rank R``); node 0's hosts the
store. Every agent keeps a beat in the store (``node/R/beat``, a counter it
bumps about twice a second, and its succession entry's beat) under the
incarnation it registered with. The store's host counts the beats
(resilient_train.protocol.succession.census) with its own clock (no clock agreement is
needed): an agent whose beat has not moved for ``node_timeout_s`` is lost,
unless the agents still beating are no majority of the last generation's
(then the host is the one cut off, and fences itself). The host claims the
loss of that incarnation (``compare_set``), declares the generation failed
(its ranks' peers are already recovering) and hands the node to a waiting
spare agent (``--spare``), which becomes node R and starts R's ranks as
replacements; they heal from live replicas like any replacement. With no
spare, the lost node's own agent may come back (a scheduler restarting it):
it registers a new incarnation and starts its ranks as replacements; an
elastic job (``--nnodes MIN:MAX``) shrinks instead of waiting for it.

The claim (``NodeKeys.lost``) is also the node's fence: a rank of that
incarnation that reads it leaves (resilient_train.rank.fence), and the node's next
agent starts its ranks once they acknowledged (``NodeKeys.fenced``).

Node 0's loss is a node's loss: the store moves to the first successor alive
with a majority of the last generation's agents (resilient_train.protocol.succession,
resilient_train.agent.succession), whose census then claims node 0.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch.distributed as dist

__all__ = ["FENCE_WAIT_S", "Heartbeat", "NodeKeys", "assign_spare", "claim_loss", "register_node", "register_spare", "wait_for_assignment"]

FENCE_WAIT_S = 5.0  # at most, for the ranks of a lost incarnation to acknowledge (capped by --node-timeout)


class NodeKeys:
    @staticmethod
    def incarnation(node: int) -> str:
        return f"rt/node/{node}/incarnation"

    @staticmethod
    def beat(node: int, incarnation: int) -> str:
        return f"rt/node/{node}/{incarnation}/beat"

    @staticmethod
    def lost(node: int, incarnation: int) -> str:
        return f"rt/node/{node}/{incarnation}/lost"

    @staticmethod
    def fenced(node: int, incarnation: int, rank: int) -> str:
        return f"rt/node/{node}/{incarnation}/fenced/{rank}"  # a rank of a lost incarnation saw its fence, and left

    @staticmethod
    def done(node: int) -> str:
        return f"rt/node/{node}/done"  # the node's agent is leaving (its ranks finished or stopped)

    SPARES = "rt/spares"  # how many spare agents registered

    @staticmethod
    def spare(i: int) -> str:
        return f"rt/spare/{i}/node"  # "" while waiting; the node rank it takes over


def register_node(store: dist.Store, node: int) -> int:
    """This agent serves ``node``: its incarnation (1 for the first agent of the node, 2 for the next, ...)."""
    incarnation = int(store.add(NodeKeys.incarnation(node), 1))
    store.add(NodeKeys.beat(node, incarnation), 1)
    return incarnation


def register_spare(store: dist.Store) -> int:
    i = int(store.add(NodeKeys.SPARES, 1)) - 1
    store.set(NodeKeys.spare(i), "")
    return i


def wait_for_assignment(store: dist.Store, spare: int, *, done: Callable[[], bool], interval_s: float = 0.2) -> int | None:
    """Blocks until a node is handed to spare ``spare``; None once ``done()`` (the job ended without needing it)."""
    key = NodeKeys.spare(spare)
    while True:
        value = store.get(key).decode()
        if value:
            return int(value)
        if done():
            return None
        time.sleep(interval_s)


def claim_loss(store: dist.Store, node: int, incarnation: int, by: int) -> bool:
    """True for exactly one agent: the one that will handle the loss of this incarnation of ``node``."""
    key = NodeKeys.lost(node, incarnation)
    return store.compare_set(key, "", str(by)).decode() == str(by)


def assign_spare(store: dist.Store, node: int) -> int | None:
    """Hands ``node`` to the first spare still waiting; its index, or None when there is none."""
    n = int(store.add(NodeKeys.SPARES, 0))
    for i in range(n):
        if store.compare_set(NodeKeys.spare(i), "", str(node)).decode() == str(node):
            return i
    return None


class Heartbeat:
    """This node's beat, on its own thread and its own store connection.

    Off the agent's loop: an agent waiting for its ranks to write a preemption
    checkpoint, or busy starting them, is still alive. Only the agent's death
    (or its host's) stops the beat.
    """

    def __init__(self, connect: Callable[[], dist.Store], node: int | None, incarnation: int, *,
                 interval_s: float = 0.5, also: tuple[str, ...] = ()) -> None:
        self._store = connect()
        # The node's beat, and any other (the agent's succession entry's: resilient_train.protocol.succession.census).
        self._keys = ([NodeKeys.beat(node, incarnation)] if node is not None else []) + list(also)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rt-node{node}-beat", daemon=True)
        self._thread.start()

    def beat(self, node: int, incarnation: int) -> None:
        """Beats for ``node`` from now on (a spare agent that took it over)."""
        self._keys = [NodeKeys.beat(node, incarnation), *(k for k in self._keys if not k.startswith("rt/node/"))]

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            for key in self._keys:
                try:
                    self._store.add(key, 1)
                except (RuntimeError, OSError):  # the store is gone or moving: the agent's own calls say so
                    break

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
