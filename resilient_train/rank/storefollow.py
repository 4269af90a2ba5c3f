"""A rank follows its own agent to the store's next host, or leaves fenced.

A rank never looks for a store by itself: its agent moves only with a
majority of the job (resilient_train.agent.succession) and then announces
the new endpoint in its file (``RT_STORE_FILE``). The rank learns of it in
two ways:

* a call of its own fails (the host died: a reset connection, or a call past
  its deadline): it waits for the announcement, as long as a move can take
  (:func:`follow`, from :func:`judge_following`);
* its agent moved while the old host still holds the rank's connections open
  and answers nothing (the host's agent stopped, its ranks training on with
  this one): nothing of the rank's fails, so a :class:`MoveNotice` thread
  reads the announcement file and follows at once. The generation the rank
  trains in is gone with the old store: the notice marks it failed on this
  rank (its watcher, resilient_train.rank.watch), whose next vote abstains, so no
  rank of the old generation commits another step.

Following moves every connection of the process (they share one location),
and marks the rank supervised there again; the rank judges its failure anew
on the new store and recovers into the new store's first generation,
reporting nothing about the old one (it is gone). No announcement in time
means its agent could not move (a minority, or it was stopped): the rank
leaves as a fenced rank does, without a write (exit 94; the agent says it,
or kills it first).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from resilient_train.protocol import env as E
from resilient_train.rank.fence import leave_fenced, leave_if_cut_off
from resilient_train.rank.lifecycle import SupervisorState
from resilient_train.protocol.store import Keys
from resilient_train.protocol.succession.location import Endpoint, announced, read_announcement
from resilient_train.protocol.succession.movable import MovableStore

__all__ = ["MOVE_TIMEOUT_S", "MoveNotice", "follow", "judge_following"]

MOVE_TIMEOUT_S = 120.0  # at most, for this rank's agent to find the store's next host and announce it
NOTICE_EVERY_S = 0.2  # how often a rank looks at its agent's announcement (one stat of a file)


def _announcement() -> Path | None:
    path = os.environ.get(E.RT_STORE_FILE)
    return Path(path) if path else None


def _mark_supervised(store: dist.Store, rank: int) -> None:
    try:
        store.set(Keys.supervised(rank), str(os.getpid()))
    except dist.DistError:
        pass  # lost again: the judgement finds out


def follow(store: dist.Store, *, rank: int, after: int) -> bool:
    """The store was lost under this rank (at epoch ``after``): True once every connection of the process
    follows the agent's move; a rank whose store cannot move returns False (node 0's ranks, one node) or
    leaves (another node's)."""
    if not isinstance(store, MovableStore):
        leave_if_cut_off(store)  # not on node 0: maybe cut off, already replaced (resilient_train.rank.fence)
        return False
    timeout_s = float(os.environ.get("RT_STORE_MOVE_TIMEOUT_S", MOVE_TIMEOUT_S))
    endpoint = announced(_announcement(), after=after, timeout_s=timeout_s)
    if endpoint is None:
        leave_fenced(store, f"the store was lost and this rank's agent announced no new one within {timeout_s:g} s")
    if store.location.move(endpoint):  # else this rank's MoveNotice followed it first
        _mark_supervised(store, rank)
    return True


def judge_following(judge: Callable[[], SupervisorState], store: dist.Store,
                    rank: int) -> tuple[SupervisorState, str | None, bool]:
    """``judge()``; made again on the store's next host each time the store is lost under it. Returns the next
    state, why the store is lost for good (None: it is not), and whether the store moved meanwhile."""
    moved = False
    while True:
        epoch = store.location.epoch if isinstance(store, MovableStore) else 0
        try:
            return judge(), None, moved
        except dist.DistNetworkError as lost:
            if not follow(store, rank=rank, after=epoch):
                return SupervisorState.FAILED, str(lost).splitlines()[0][:200], moved
            moved = True


class MoveNotice:
    """Follows this rank's agent to the store's next host as soon as it announces one, and then calls
    ``on_move`` (the rank's generation is gone with the old store). A thread that stats one small file every
    :data:`NOTICE_EVERY_S`; nothing when the store cannot move (one node, or no agent)."""

    def __init__(self, store: MovableStore, path: Path, *, rank: int, on_move: Callable[[], None],
                 interval_s: float = NOTICE_EVERY_S) -> None:
        self._store, self._path, self._rank = store, path, rank
        self._on_move, self._interval_s = on_move, interval_s
        self._closed = threading.Event()
        self._seen: tuple[int, int, int] | None = None  # the file's (inode, mtime, size) last read
        self._thread = threading.Thread(target=self._loop, name=f"rt-move-notice-rank{rank}", daemon=True)
        self._thread.start()

    @classmethod
    def for_store(cls, store: dist.Store, *, rank: int, on_move: Callable[[], None]) -> "MoveNotice | None":
        path = _announcement()
        if not isinstance(store, MovableStore) or path is None:
            return None
        return cls(store, path, rank=rank, on_move=on_move)

    def close(self, timeout: float = 2.0) -> None:
        self._closed.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._closed.wait(self._interval_s):
            endpoint = self._read()
            if endpoint is None or not self._store.location.move(endpoint):
                continue
            self._on_move()  # first: the generation is over before anything else is said to the new store
            _mark_supervised(self._store, self._rank)

    def _read(self) -> Endpoint | None:
        """The announced endpoint if the file changed since it was last read, else None."""
        try:
            st = self._path.stat()
        except OSError:
            return None  # none announced yet
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)  # the agent renames a new file over it
        if seen == self._seen:
            return None
        self._seen = seen
        return read_announcement(self._path)
