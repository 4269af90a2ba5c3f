"""A rank's copies, in the first successor's store, of what only the store holds and only the rank can write.

A rank publishes its local state (RNG streams, data position, the script's
extra state) in the store at every step, before the step's vote
(resilient_train.rank.local_state): a replacement takes it over from there. If
the store's host dies with a rank (node 0's), that rank's local state would
die with both. So each rank also writes it to the store of the first agent
in the succession, the store's next host when the host is lost
(resilient_train.protocol.succession.rules): there, after the move, it is where
the replacement reads it. One more ``set`` per step, to another host; a
mirror that fails is dropped until the next generation (the job goes on: a
rank lost with the host may then have to be restored from disk).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from resilient_train.rank.parts import Part
from resilient_train.protocol.succession.location import Endpoint, StoreLocation
from resilient_train.protocol.succession.movable import MovableStore
from resilient_train.protocol.succession.rules import SuccessionKeys, Succession

__all__ = ["Mirror", "MirrorPart"]

_CALL_S = 2.0  # a mirror that does not answer within this is dropped until the next generation


class Mirror:
    def __init__(self, location: StoreLocation) -> None:
        self._location = location
        self._target: tuple[str, int] | None = None
        self._store: MovableStore | None = None

    @property
    def target(self) -> tuple[str, int] | None:
        return self._target if self._store is not None else None

    def retarget(self, store: dist.Store) -> None:
        """The first successor of the store's host, from the succession the host keeps (each generation)."""
        try:
            raw = store.get(SuccessionKeys.LIST) if store.check([SuccessionKeys.LIST]) else None
        except dist.DistError:
            return
        agents = Succession.from_json(raw).agents if raw is not None else ()
        target = (agents[0].addr, agents[0].port) if agents else None
        if target == self._target and self._store is not None:
            return
        self._target = target
        self._store = None if target is None else MovableStore(StoreLocation(
            Endpoint(*target), wrap=self._location.wrap, timeout=timedelta(seconds=_CALL_S), call_timeout_s=_CALL_S))

    def copy(self, key: str, value: str | bytes) -> None:
        if self._store is None:
            return
        try:
            self._store.set(key, value)
        except dist.DistError:
            self._store = None  # until the next generation looks again


class MirrorPart(Part):
    """Looks for the first successor at each generation."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror

    def on_generation(self, generation: int, store: dist.Store) -> None:
        self.mirror.retarget(store)
