"""A rank whose store went follows its own agent to the next one, or leaves fenced.

A rank never looks for a store by itself: its agent moves only with a
majority of the job (resilient_train.agent.succession) and then announces
the new endpoint in its file (``RT_STORE_FILE``). The rank waits for that
announcement, as long as a move can take, moves every connection of the
process (they share one location), marks itself supervised there again, and
judges its failure anew on the new store; it then recovers into the new
store's first generation, reporting nothing about the old one (it is gone).
No announcement in time means its agent could not move (a minority, or it
was stopped): the rank leaves as a fenced rank does, without a write (exit
94; the agent says it, or kills it first).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from resilient_train.protocol import env as E
from resilient_train.rank.fence import leave_if_cut_off, leave_fenced
from resilient_train.rank.lifecycle import SupervisorState
from resilient_train.protocol.store import Keys
from resilient_train.protocol.succession.location import announced
from resilient_train.protocol.succession.movable import MovableStore

__all__ = ["MOVE_TIMEOUT_S", "follow", "judge_following"]

MOVE_TIMEOUT_S = 120.0  # at most, for this rank's agent to find the store's next host and announce it


def follow(store: dist.Store, *, rank: int, supervised_key: str) -> bool:
    """The store was lost under this rank: True once every connection of the process follows the agent's move;
    a rank whose store cannot move returns False (node 0's ranks, one node) or leaves (another node's)."""
    if not isinstance(store, MovableStore):
        leave_if_cut_off(store)  # not on node 0: maybe cut off, already replaced (resilient_train.rank.fence)
        return False
    path = os.environ.get(E.RT_STORE_FILE)
    timeout_s = float(os.environ.get("RT_STORE_MOVE_TIMEOUT_S", MOVE_TIMEOUT_S))
    endpoint = announced(Path(path) if path else None, after=store.location.epoch, timeout_s=timeout_s)
    if endpoint is None:
        leave_fenced(store, f"the store was lost and this rank's agent announced no new one within {timeout_s:g} s")
    store.location.move(endpoint)
    try:
        store.set(supervised_key, str(os.getpid()))
    except dist.DistError:
        pass  # lost again: the judgement finds out
    return True


def judge_following(judge: Callable[[], SupervisorState], store: dist.Store,
                    rank: int) -> tuple[SupervisorState, str | None, bool]:
    """``judge()``; made again on the store's next host each time the store is lost under it. Returns the next
    state, why the store is lost for good (None: it is not), and whether the store moved meanwhile."""
    moved = False
    while True:
        try:
            return judge(), None, moved
        except dist.DistNetworkError as lost:
            if not follow(store, rank=rank, supervised_key=Keys.supervised(rank)):
                return SupervisorState.FAILED, str(lost).splitlines()[0][:200], moved
            moved = True
