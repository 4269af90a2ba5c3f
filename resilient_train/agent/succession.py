"""The agent's side of the store's succession (resilient_train.protocol.succession): a standby store, an entry, the move.

Every agent of a many-node job registers an entry in the store: the address
and port of a standby store it serves from the start (node 0's agent: the
store itself), its node or spare index and its incarnation. The host keeps
the succession (the live agents, nodes by node rank, then spares) in one
key, and a census of their beats (resilient_train.protocol.succession.census); every
other agent reads the succession once a second.

When an agent loses the store (a reset connection, or a call past its
deadline), :meth:`AgentSuccession.move` tries the successors in order:

* itself: it opens its standby store for the next epoch and waits for the
  agents of the last generation to come; with a majority
  (resilient_train.protocol.succession.rules.majority) it seeds what the new store
  needs (the generation counter past every generation its agents knew, the
  lost host's node claimed lost, the spares, an elastic job's members), marks
  it open, and hosts;
* another: it registers there and waits for the store to open, as long as a
  successor needs to find out and gather a majority; a successor whose port
  does not take a connection at once is not alive: the next one is tried.

No successor opening (this side has no majority, or every successor is gone)
is :class:`NotMoved`: the caller fences the node (94), or stops the job (75)
when the host is known dead and the others cannot form a generation (a 2-node
job without a spare: resume from the newest checkpoint).
"""

from __future__ import annotations

import errno
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from resilient_train.protocol.succession.location import call_timeout_s
from resilient_train.agent.glooif import source_address
from resilient_train.protocol.members import members_key, read_members
from resilient_train.protocol.jobtoken import check_fingerprint, publish_fingerprint
from resilient_train.protocol.nodes import NodeKeys
from resilient_train.protocol.store import Keys as StoreKeys
from resilient_train.protocol.store import current_generation
from resilient_train.protocol.succession.census import Census
from resilient_train.protocol.succession.location import Endpoint, StoreLocation, StoreLost
from resilient_train.protocol.succession.movable import MovableStore
from resilient_train.protocol.succession.rules import AgentEntry, SuccessionKeys, Succession, majority, read_entries, register

__all__ = ["MOVED_CLAIM", "AgentSuccession", "Moved", "NotMoved", "Standby", "majority_wait_s"]

PROBE_S = 1.0  # a successor whose port takes no connection within this is not alive
JOIN_GRACE_S = 1.0  # once a majority came, how long the new host waits for the rest of the last generation
_LOOK_EVERY_S = 1.0
_POLL_S = 0.05
MOVED_CLAIM = "moved"  # the loss claim of a node lost with the store it hosted (its ranks can never come back)


def majority_wait_s(node_timeout_s: float) -> float:
    """How long a new host waits for a majority: the others find the loss within a call's deadline."""
    return call_timeout_s(node_timeout_s) + 5.0


def join_wait_s(node_timeout_s: float) -> float:
    """How long an agent waits at a live successor for its store to open."""
    return call_timeout_s(node_timeout_s) + majority_wait_s(node_timeout_s) + 2.0


class Standby:
    """A store this agent serves from the start, on an address the others reach its node by; empty until the
    job's store moves here."""

    def __init__(self, master_addr: str) -> None:
        addr = source_address(master_addr) or master_addr
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, 0))
        sock.listen(4096)
        self.addr, self.port = addr, int(sock.getsockname()[1])
        self.server = dist.TCPStore(addr, self.port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60), master_listen_fd=sock.detach(), use_libuv=False)


@dataclass(frozen=True)
class Moved:
    endpoint: Endpoint
    hosting: bool
    previous_host: AgentEntry
    present: tuple[int, ...]
    voters: tuple[int, ...]
    waited_s: float
    lost: tuple[AgentEntry, ...] = ()  # (new host) node agents of the last generation that did not come


@dataclass(frozen=True)
class NotMoved:
    reason: str
    host_dead: bool  # the previous host's port refused a connection: its process is gone, not cut off


class AgentSuccession:
    """One agent's place in the succession. ``wrap`` turns a raw store into the job's view (namespace, attempt)."""

    def __init__(self, *, master_addr: str, token: str, node_timeout_s: float, hosting: bool,
                 wrap: Callable[[dist.Store], dist.Store], source: str) -> None:
        self.token, self.node_timeout_s, self._wrap, self._source = token, node_timeout_s, wrap, source
        self.standby = None if hosting else Standby(master_addr)
        self.entry: AgentEntry | None = None
        self.known: Succession | None = None
        self.census: Census | None = None
        self.generation_seen = 0
        self.members_seen: list[int] | None = None
        self._looked_at = 0.0
        self._written: str | None = None

    # ---------------------------------------------------------- the entry
    def register(self, store: dist.Store, *, addr: str, port: int, node: int | None, incarnation: int,
                 spare: int | None) -> AgentEntry:
        """This agent's entry (``addr:port``: its standby store, or the store it hosts)."""
        if self.standby is not None:
            addr, port = self.standby.addr, self.standby.port
        self.entry = register(store, {"addr": addr, "port": port, "node": node, "incarnation": incarnation,
                                      "spare": spare})
        return self.entry

    def take_node(self, store: dist.Store, node: int, incarnation: int) -> None:
        """A spare agent now serves ``node``: its entry says so (same index)."""
        assert self.entry is not None
        self.entry = AgentEntry(index=self.entry.index, addr=self.entry.addr, port=self.entry.port, node=node,
                                incarnation=incarnation, spare=self.entry.spare)
        store.set(SuccessionKeys.entry(self.entry.index), self.entry.to_json())

    # ------------------------------------------------------------- looks
    def poll(self, store: dist.Store, *, hosting: bool, elastic: bool) -> list[AgentEntry]:
        """Once a second: the host rebuilds the succession and reads its census (the absent agents, returned);
        every agent remembers the succession and the generation."""
        now = time.monotonic()
        if now - self._looked_at < _LOOK_EVERY_S or self.entry is None:
            return []
        self._looked_at = now
        g = current_generation(store)
        self.generation_seen = max(self.generation_seen, g)
        if elastic:
            self.members_seen = read_members(store, g) or self.members_seen
        if not hosting:
            if store.check([SuccessionKeys.LIST]):
                self.known = Succession.from_json(store.get(SuccessionKeys.LIST))
            return []
        live = self._live(store)
        epoch = int(store.get(SuccessionKeys.EPOCH)) if store.check([SuccessionKeys.EPOCH]) else 0
        others = tuple(e for e in live if e.index != self.entry.index)
        self.known = Succession(epoch=epoch, host=self.entry, agents=others)
        text = self.known.to_json()
        if text != self._written:
            store.set(SuccessionKeys.LIST, text)
            self._written = text
        if self.census is None:
            self.census = Census(host=self.entry.index, timeout_s=self.node_timeout_s)
        return self.census.observe(store, list(self.known.agents), now)

    def _live(self, store: dist.Store) -> list[AgentEntry]:
        """Registered agents not declared lost (a node's newest incarnation; spares still waiting), in order."""
        out: dict[tuple[int, int], AgentEntry] = {}
        for e in read_entries(store):
            if e.node is not None:
                if store.check([NodeKeys.lost(e.node, e.incarnation)]):
                    continue
                if int(store.add(NodeKeys.incarnation(e.node), 0)) != e.incarnation:
                    continue
            elif e.spare is not None and store.get(NodeKeys.spare(e.spare)).decode() not in ("",):
                continue  # a spare handed a node registers again as that node (take_node), or is gone
            out[e.order()] = e
        return [out[k] for k in sorted(out)]

    def allows_loss(self, index: int | None) -> bool:
        """(The host) whether a majority is present without agent ``index``: else the host is the one cut off."""
        return self.census is None or self.census.allows_loss(index)

    def index_of_node(self, node: int) -> int | None:
        if self.known is None:
            return None
        for e in (self.known.host, *self.known.agents):
            if e.node == node:
                return e.index
        return None

    # -------------------------------------------------------------- move
    def move(self) -> Moved | NotMoved:
        """The store's host is lost: find or become the next one (module docstring)."""
        known, me = self.known, self.entry
        if known is None or me is None:
            return NotMoved("this agent had not learnt the store's succession yet", host_dead=False)
        t0 = time.monotonic()
        epoch = known.epoch + 1
        answers = _probe([known.host, *(a for a in known.agents if a.index != me.index)])
        host_dead = answers[known.host.index] == "refused"
        if not any(answers[a.index] == "accepts" for a in known.agents if a.index != me.index):
            # Nobody else of the job can be reached: this node is the one cut off (or the only one left).
            return NotMoved("no other agent of the job answers", host_dead)
        for cand in known.agents:
            if cand.index == me.index:
                return self._open(epoch, known, host_dead, t0)
            moved = self._join(cand, epoch, known, t0) if answers[cand.index] == "accepts" else None
            if moved is not None:
                return moved
        return NotMoved("no successor of the store opened one (this agent is not in the succession)", host_dead)

    def _info(self) -> str:
        return json.dumps({"entry": json.loads(self.entry.to_json()) if self.entry else None,
                           "generation": self.generation_seen, "members": self.members_seen})

    def _join(self, cand: AgentEntry, epoch: int, known: Succession, t0: float) -> Moved | None:
        if not _accepts(cand):
            return None
        location = StoreLocation(Endpoint(cand.addr, cand.port, epoch), wrap=self._wrap,
                                 timeout=timedelta(seconds=PROBE_S * 5), call_timeout_s=PROBE_S * 2)
        deadline = time.monotonic() + join_wait_s(self.node_timeout_s)
        try:
            view = MovableStore(location)
            assert self.entry is not None
            view.set(SuccessionKeys.joined(epoch, self.entry.index), self._info())
            while time.monotonic() < deadline:
                if view.check([SuccessionKeys.OPEN]):
                    opened = int(view.get(SuccessionKeys.OPEN))
                    if opened >= epoch:
                        raw = dist.TCPStore(cand.addr, cand.port, is_master=False, timeout=timedelta(seconds=5))
                        check_fingerprint(raw, self.token, source=self._source, timeout_s=5.0)
                        new = Succession.from_json(view.get(SuccessionKeys.LIST))
                        return Moved(endpoint=Endpoint(cand.addr, cand.port, opened), hosting=False,
                                     previous_host=known.host, present=tuple(a.index for a in (new.host, *new.agents)),
                                     voters=tuple(sorted(known.voters)), waited_s=time.monotonic() - t0)
                time.sleep(_POLL_S)
        except (StoreLost, ValueError, RuntimeError, OSError):
            return None
        return None

    def _open(self, epoch: int, known: Succession, host_dead: bool, t0: float) -> Moved | NotMoved:
        assert self.standby is not None and self.entry is not None
        me = self.entry
        store = self._wrap(self.standby.server)
        store.set(SuccessionKeys.EPOCH, str(epoch))
        store.set(SuccessionKeys.joined(epoch, me.index), self._info())
        voters = known.voters
        expected = voters - {known.host.index}
        deadline = time.monotonic() + majority_wait_s(self.node_timeout_s)
        since: float | None = None
        while True:
            present = {i for i in voters if store.check([SuccessionKeys.joined(epoch, i)])}
            now = time.monotonic()
            if majority(voters, present, known.host.index):
                since = since if since is not None else now
                if present >= expected or now - since >= JOIN_GRACE_S:
                    break
            if now >= deadline or present >= expected:  # every agent but the lost host came: no more will
                return NotMoved(f"only {len(present)} of the {len(voters)} agents of the last generation reached "
                                f"this agent's standby store (waited {now - t0:.1f} s); a generation needs a majority "
                                "of them", host_dead)
            time.sleep(_POLL_S)
        infos = [json.loads(store.get(SuccessionKeys.joined(epoch, i))) for i in sorted(present)]
        lost = tuple(a for a in known.agents if a.index not in present and a.node is not None)
        self._seed(store, epoch, known, infos, lost)
        return Moved(endpoint=Endpoint(self.standby.addr, self.standby.port, epoch), hosting=True,
                     previous_host=known.host, present=tuple(sorted(present)), voters=tuple(sorted(voters)),
                     waited_s=time.monotonic() - t0, lost=lost)

    def _seed(self, store: dist.Store, epoch: int, known: Succession, infos: list[dict[str, Any]],
              lost: tuple[AgentEntry, ...]) -> None:
        """What the fresh store needs before it opens (resilient_train.protocol.succession.rules's table)."""
        assert self.standby is not None and self.entry is not None
        publish_fingerprint(self.standby.server, self.token)  # outside the namespace, as node 0 does
        entries = [AgentEntry.from_dict(i["entry"]) for i in infos if i.get("entry")]
        g = max([self.generation_seen, *(int(i.get("generation") or 0) for i in infos)]) + 2
        store.set(StoreKeys.GENERATION, str(g))
        members = next((i["members"] for i in sorted(infos, key=lambda i: -int(i.get("generation") or 0))
                        if i.get("members") is not None), None)
        for gone in (known.host, *lost):  # their nodes are lost: the claim is their fence
            if gone.node is not None:
                store.add(NodeKeys.incarnation(gone.node), gone.incarnation)
                store.set(NodeKeys.lost(gone.node, gone.incarnation), f"{MOVED_CLAIM}:{self.entry.index}")
        spares = [e for e in (known.host, *known.agents) if e.spare is not None]
        store.add(NodeKeys.SPARES, max((e.spare for e in spares), default=-1) + 1)  # type: ignore[type-var]
        came = {e.index for e in entries}
        for e in spares:
            waiting = e.node is None and e.index in came
            store.set(NodeKeys.spare(e.spare), "" if waiting else (str(e.node) if e.node is not None else "gone"))
        store.add(SuccessionKeys.AGENTS, max(e.index for e in (known.host, *known.agents)) + 1)
        for e in entries:
            store.set(SuccessionKeys.entry(e.index), e.to_json())
        if members is not None:  # the last generation's: the losses are handed on once the store opened
            store.set(members_key(g), json.dumps(members))
            self.members_seen = members
        self.generation_seen = g
        others = tuple(e for e in sorted(entries, key=AgentEntry.order) if e.index != self.entry.index)
        me = AgentEntry(index=self.entry.index, addr=self.standby.addr, port=self.standby.port, node=self.entry.node,
                        incarnation=self.entry.incarnation, spare=self.entry.spare)
        self.known = Succession(epoch=epoch, host=me, agents=others)
        store.set(SuccessionKeys.LIST, self.known.to_json())
        self._written = self.known.to_json()
        self.census = Census(host=me.index, timeout_s=self.node_timeout_s)
        store.set(SuccessionKeys.OPEN, str(epoch))


def _accepts(entry: AgentEntry) -> bool:
    """Whether ``entry``'s port takes a connection within :data:`PROBE_S` (a listening process lives there)."""
    return _answer(entry) == "accepts"


def _answer(entry: AgentEntry) -> str:
    """How ``entry``'s port answers: "accepts", "refused" (its process is gone), or "silent" (a cut, a dead host)."""
    try:
        with socket.create_connection((entry.addr, entry.port), timeout=PROBE_S):
            return "accepts"
    except OSError as e:
        return "refused" if isinstance(e, ConnectionRefusedError) or e.errno == errno.ECONNREFUSED else "silent"


def _probe(entries: list[AgentEntry]) -> dict[int, str]:
    """:func:`_answer` of every entry, at once (each on a thread): at most :data:`PROBE_S` in all."""
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(entries)))) as pool:
        return dict(zip((e.index for e in entries), pool.map(_answer, entries)))
