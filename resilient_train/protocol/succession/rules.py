"""The store's succession: its keys, the agents' registry, who comes next, and the majority rule.

**The store's state is soft.** What every key family becomes when the store
moves (the new host opens a fresh store in the same secret namespace):

======================================  ===================================================================
key family                              after a move
======================================  ===================================================================
job token fingerprint                   published again by the new host; each joiner checks it
generation counter (``rt/generation``)  set by the new host past every generation its joiners knew
generations (members, plans, faults,    gone: every rank's step failed with the store; all join the new
wakes, process-group rendezvous)        host's first generation, whose plan is made afresh
node incarnations, beats                each agent registers its own again (the same incarnation); the lost
                                        host's node is claimed lost (its fence) before the store opens
spare registrations                     each spare that came registers its index again; one that did not
                                        is marked gone (never handed a node)
liveness port                           the new host listens on one of its own; the agents reconnect
fence claims and acknowledgements       the lost host's node's claim is set by the new host (its ranks, if
                                        alive, find it when they come); others: made again as losses come
elastic members (``rt/width/...``)      the new host writes its first generation's members
stop, preemption, shutdown keys         gone with the store: a stop or preemption under way when the store went
                                        is lost with it (a signal sent again stops the job)
checkpoint coordination (per            gone: a save in flight is not committed (its staging directory is
generation)                             never loaded); the next save commits in the new store
local states of the ranks               copied as they are published to the first successor's store (the
(``rt/local/...``)                      mirror), so a rank that died with the host can be healed; a rank of
                                        a fenced node may still copy the boundary after its last commit
                                        there, which the ring of three never lets overwrite the survivors'
supervised marks                        set again by each rank as it follows its agent; the lost node's ranks'
                                        by the new host (its spare starts them as replacements)
preemption graces                       the agents' default until a rank's grace changes
chaos fired marks                       unaffected: under an agent they are files in the run directory
                                        (``.chaos/fired-N``; the store holds them only for a rank with no
                                        run directory, which no agent starts)
the dashboard                           reads the run directory, not the store: unaffected
======================================  ===================================================================

**Succession.** Every agent registers an entry (its node or spare index,
incarnation, and the address and port of its standby store) and beats. The
host keeps one key with the succession: the live agents, nodes by node rank,
then spares, each agent reads it once a second. When the host is lost, the
agents try the successors in that order (:mod:`resilient_train.agent.succession`).

**Majority.** A generation forms only with more than half of the previous
generation's agents, or exactly half including the agent that hosted the
previous store (:func:`majority`). Two disjoint sides cannot both hold more
than half, and only one holds the previous host: two copies of the job never
train or commit at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Iterable

import torch.distributed as dist

__all__ = ["AgentEntry", "Succession", "SuccessionKeys", "majority", "read_entries", "register"]


class SuccessionKeys:
    EPOCH = "rt/store/epoch"  # the epoch this store serves (0: node 0's agent's, at the start)
    OPEN = "rt/store/open"  # set to the epoch once a majority came: generations may form
    LIST = "rt/store/succession"  # the host's view: JSON of Succession
    AGENTS = "rt/store/agents"  # a counter: entries registered

    @staticmethod
    def entry(index: int) -> str:
        return f"rt/store/agent/{index}"

    @staticmethod
    def beat(index: int) -> str:
        return f"rt/store/agent/{index}/beat"

    @staticmethod
    def joined(epoch: int, index: int) -> str:
        """An agent of the previous generation came to this store for ``epoch`` (JSON: what it knows)."""
        return f"rt/store/{epoch}/joined/{index}"


@dataclass(frozen=True)
class AgentEntry:
    """One agent of the job, as the succession knows it. ``index``: its registration, unique for the job."""

    index: int
    addr: str
    port: int  # its standby store (the host's entry: the store it serves)
    node: int | None = None  # the node it serves, None for a spare still waiting
    incarnation: int = 0
    spare: int | None = None  # its spare index, when it registered as a spare

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "AgentEntry":
        return cls(index=int(d["index"]), addr=str(d["addr"]), port=int(d["port"]),
                   node=None if d.get("node") is None else int(d["node"]), incarnation=int(d.get("incarnation", 0)),
                   spare=None if d.get("spare") is None else int(d["spare"]))

    @property
    def name(self) -> str:
        return f"node {self.node}" if self.node is not None else f"spare node agent {self.spare}"

    def order(self) -> tuple[int, int]:
        """Nodes by node rank, then waiting spares by spare index."""
        return (0, self.node) if self.node is not None else (1, self.spare if self.spare is not None else self.index)


@dataclass(frozen=True)
class Succession:
    """The host's entry, the epoch it serves, and the other live agents in succession order."""

    epoch: int
    host: AgentEntry
    agents: tuple[AgentEntry, ...]

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "host": asdict(self.host), "agents": [asdict(a) for a in self.agents]})

    @classmethod
    def from_json(cls, data: str | bytes) -> "Succession":
        d = json.loads(data)
        return cls(epoch=int(d["epoch"]), host=AgentEntry.from_dict(d["host"]),
                   agents=tuple(AgentEntry.from_dict(a) for a in d["agents"]))

    @property
    def voters(self) -> frozenset[int]:
        """The previous generation's agents: the host and every live agent."""
        return frozenset({self.host.index, *(a.index for a in self.agents)})


def majority(voters: Iterable[int], present: Iterable[int], previous_host: int) -> bool:
    """More than half of ``voters`` are ``present``, or exactly half with the previous host among them."""
    voters, present = set(voters), set(present)
    here = len(voters & present)
    return 2 * here > len(voters) or (2 * here == len(voters) and previous_host in present)


def register(store: dist.Store, entry_without_index: dict) -> AgentEntry:
    """Registers an agent (a new index), its entry written; returns it."""
    index = int(store.add(SuccessionKeys.AGENTS, 1)) - 1
    entry = AgentEntry.from_dict({**entry_without_index, "index": index})
    store.set(SuccessionKeys.entry(index), entry.to_json())
    return entry


def read_entries(store: dist.Store) -> list[AgentEntry]:
    """Every registered entry (one wait-free read per entry)."""
    n = int(store.add(SuccessionKeys.AGENTS, 0))
    keys = [SuccessionKeys.entry(i) for i in range(n)]
    present = [k for k in keys if store.check([k])]
    return [AgentEntry.from_dict(json.loads(v)) for v in (store.multi_get(present) if present else [])]
