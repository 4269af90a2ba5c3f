"""The store host's census: which agents of the job still beat, and whether they are a majority.

Every agent (a node's or a waiting spare's) bumps a beat under its entry
(resilient_train.protocol.succession.rules). The host reads them all once a
second with its own clock, as resilient_train.protocol.nodes' watchers do: an agent
whose beat has not moved for the node timeout is absent. The host claims a
node lost only while the agents present, without that node, are a majority
of the voters (the live agents as of the last look at which every one of them
beat): a host cut off from most of the job does not declare the others lost
one by one and go on alone (a shrinking majority); it finds itself in the
minority at the first claim and is fenced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch.distributed as dist

from resilient_train.protocol.succession.rules import AgentEntry, SuccessionKeys, majority

__all__ = ["FRESH_S", "Census"]

FRESH_S = 1.5  # a beat this recent counts toward a majority: every agent beats twice a second


@dataclass
class _Seen:
    beat: int
    changed_at: float


@dataclass
class Census:
    host: int  # the host's own entry index: always present
    timeout_s: float
    _seen: dict[int, _Seen] = field(default_factory=dict)
    voters: frozenset[int] = frozenset()
    excused_until: float = 0.0

    def observe(self, store: dist.Store, entries: list[AgentEntry], now: float | None = None) -> list[AgentEntry]:
        """Reads the beats of ``entries`` (the live agents); returns those absent now."""
        now = time.monotonic() if now is None else now
        live = {e.index for e in entries} | {self.host}
        for e in entries:
            if e.index == self.host:
                continue
            beat = int(store.add(SuccessionKeys.beat(e.index), 0))
            seen = self._seen.get(e.index)
            if seen is None or seen.beat != beat:
                self._seen[e.index] = _Seen(beat, max(now, self.excused_until))
        for gone in set(self._seen) - live:
            del self._seen[gone]
        absent = [e for e in entries if e.index != self.host and not self._present(e.index, now)]
        if not absent:
            self.voters = frozenset(live)  # every live agent beats: the voters of what comes next
        return absent

    def excuse(self, now: float) -> None:
        """The host did not run until ``now`` (its own pause): beats it did not see count as seen then."""
        self.excused_until = now
        for index, seen in self._seen.items():
            self._seen[index] = _Seen(seen.beat, max(seen.changed_at, now))

    def present(self, now: float | None = None) -> set[int]:
        now = time.monotonic() if now is None else now
        return {self.host, *(i for i in self._seen if self._present(i, now))}

    def allows_loss(self, index: int | None, now: float | None = None) -> bool:
        """Whether the agents present without ``index`` (an agent about to be declared lost) are a majority.

        Present here is stricter than not lost: a beat seen within :data:`FRESH_S` (the host reads every
        beat once a second, and each agent beats twice a second). The agents cut off with the one claimed
        went silent at the same moment; counted as present until their own timeout, they would let a host
        cut off from them claim them lost one by one, handing nodes on in a store nobody else reaches."""
        now = time.monotonic() if now is None else now
        fresh = min(self.timeout_s, FRESH_S)
        present = {self.host, *(i for i, seen in self._seen.items() if now - seen.changed_at <= fresh)}
        present -= {index} if index is not None else set()
        voters = self.voters or frozenset(present)
        return majority(voters, present, self.host)

    def _present(self, index: int, now: float) -> bool:
        seen = self._seen.get(index)
        return seen is not None and now - seen.changed_at <= self.timeout_s
