"""This agent's place in a many-node job: its node's registration and beat, the losses it sees, its leaving.

The keys and the ring of watchers are resilient_train.protocol.nodes'. Here is what
one agent does with them: it registers an incarnation of its node and beats
on its own thread; it reports the nodes it watches that went silent
(:class:`~resilient_train.agent.events.NodeLost`) and, when its claim wins,
fails the generation and hands the node to a waiting spare; a spare node's
agent waits for a node to be handed to it (``NodeAssigned``) or for the job
to end without it (``JobEnded``). When its ranks are done it says so, and
node 0's agent, which hosts the store, waits for every node before it goes.
"""

from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist

from monitors import EventLog
from resilient_train.protocol.succession.location import call_timeout_s
from resilient_train.agent.config import AgentConfig
from resilient_train.agent.events import Fenced, JobEnded, NodeAssigned, NodeLost
from resilient_train.protocol.nodes import (
    FENCE_WAIT_S, Heartbeat, NodeKeys, assign_spare, claim_loss, register_node, register_spare,
)
from resilient_train.base import exitcodes
from resilient_train.agent.liveness import LivenessClient, LivenessServer
from resilient_train.agent.succession import MOVED_CLAIM, AgentSuccession, Moved
from resilient_train.protocol.succession.rules import SuccessionKeys
from resilient_train.agent.width import BelowMinimum, grow, is_member, shrink, start_members, wait_for_start
from resilient_train.protocol.members import members_of
from resilient_train.protocol.store import (
    Keys, current_generation, declare_fault, interrupt_for_stop, read_stop, request_stop,
)
from resilient_train.protocol.succession.location import Endpoint

__all__ = ["Membership", "fence_wait_s"]

_ASSIGNMENT_EVERY_S = 0.2  # how often a waiting spare looks for a node handed to it
_FENCE_CHECK_EVERY_S = 1.0  # how often an agent looks whether its own node was declared lost
LEAVE_TIMEOUT_S = 60.0  # node 0 keeps the store this long at most for the other nodes to leave


def fence_wait_s(node_timeout_s: float) -> float:
    """How long the agent that takes a node over waits for the lost incarnation's ranks to acknowledge their
    fence before it starts the replacements: ``min(FENCE_WAIT_S, node timeout)``, and, when that node is only
    cut off (its ranks alive, unable to read their fence), until its own agent has given up on the store and
    killed them (resilient_train.rank.fence): its store calls' deadline (``call_timeout_s``) runs from about when
    its beat stopped, and exceeds the node timeout below 5 s."""
    return min(FENCE_WAIT_S, node_timeout_s) + max(0.0, call_timeout_s(node_timeout_s) - node_timeout_s)


class Membership:
    """One agent of a many-node job (``config.nnodes > 1``)."""

    def __init__(self, config: AgentConfig, *, events: EventLog, say: Callable[[str], None], token: str = "",
                 succession: AgentSuccession, endpoint: Callable[[], Endpoint]) -> None:
        assert config.nnodes > 1
        self.config, self.events, self._say = config, events, say
        self._token = token  # the job's secret: the liveness connection's proof (resilient_train.agent.liveness)
        self.succession = succession  # the store's successors, the host's census (resilient_train.agent.succession)
        self._endpoint = endpoint  # where the store is now
        self._liveness: LivenessServer | LivenessClient | None = None
        self.incarnation = 0
        self.spare_index: int | None = None
        self._heartbeat: Heartbeat | None = None
        self._handled: set[tuple[int, int]] = set()
        self._looked_at = 0.0
        self._fence_checked_at = 0.0

    # --------------------------------------------------------------- a node
    def enter(self, store: dist.Store, connect: Callable[[], dist.Store]) -> tuple[bool, int]:
        """Registers this node (:meth:`register`); whether its ranks start as replacements, and the generation
        they start in. An elastic job (resilient_train.agent.width): node 0's agent names the first nodes; a
        node not among the current members (it came back, or came late) grows the job."""
        returning = self.register(store, connect)
        c = self.config
        if not c.elastic:
            return returning, current_generation(store) if returning else 0
        if c.node_rank == 0 and not c.spare:
            members = start_members(store, c, self._say)
            self.events.emit("width_request", generation=0, cause="start", members=members,
                             nodes=sorted({m // c.nproc_per_node for m in members}), width=c.world_size)
            return False, 0
        wait_for_start(store, c)
        if is_member(store, c, c.node_rank):
            return returning, current_generation(store) if returning else 0
        g = grow(store, c, c.node_rank)
        members = members_of(store, g, c.world_size)
        self.events.emit("width_request", generation=g, cause="grow", node=c.node_rank, members=members,
                         nodes=sorted({m // c.nproc_per_node for m in members}), width=c.world_size)
        self._say(f"node {c.node_rank} joins the job at generation {g}: its ranks heal from a live replica and "
                  "take their logical ranks back")
        return True, g

    def register(self, store: dist.Store, connect: Callable[[], dist.Store]) -> bool:
        """Registers this agent as its node's next incarnation and starts its beat; True when the node's ranks
        ran before (the node comes back, or a spare takes it): they start as replacements."""
        c = self.config
        self.incarnation = register_node(store, c.node_rank)
        hosting = c.node_rank == 0 and not c.spare  # node 0's agent hosts the store: it sees the others die at once
        here = self._endpoint()
        if self.succession.entry is None:
            self.succession.register(store, addr=here.addr, port=here.port, node=c.node_rank,
                                     incarnation=self.incarnation, spare=None)
        else:  # a spare agent takes this node over: its entry says so
            self.succession.take_node(store, c.node_rank, self.incarnation)
        if self._heartbeat is not None:
            self._heartbeat.close()
        entry = self.succession.entry
        assert entry is not None
        self._heartbeat = Heartbeat(connect, c.node_rank, self.incarnation, also=(SuccessionKeys.beat(entry.index),))
        self._listen(store, hosting=hosting)
        returning = (self.incarnation > 1 or c.spare) and store.check([Keys.supervised(c.first_rank)])
        self.events.emit("node_started", node=c.node_rank, incarnation=self.incarnation, returning=returning)
        if self.incarnation > 1:
            self._fence_previous(store, returning)
        return returning

    def _fence_previous(self, store: dist.Store, returning: bool) -> None:
        """Before this node's ranks start again: the previous incarnation's ranks can no longer join (its loss
        is claimed), and each has left, or had :data:`FENCE_WAIT_S` to (resilient_train.protocol.nodes)."""
        c = self.config
        previous = self.incarnation - 1
        if claim_loss(store, c.node_rank, previous, by=c.node_rank) and returning:
            # Nobody had declared it lost (this agent came back first): fail the generation, which wakes
            # every rank, so that a live rank of the previous agent sees its fence now.
            declare_fault(store, current_generation(store), {
                "rank": c.first_rank, "kind": "node_lost", "node": c.node_rank, "time": time.time()},
                world_size=c.world_size)
        if store.get(NodeKeys.lost(c.node_rank, previous)).decode().startswith(MOVED_CLAIM):
            # Lost with the store it hosted: its ranks can only reach the store through that agent's word (they
            # follow their own agent: resilient_train.rank.storefollow), which never comes. Nothing to wait for.
            self.events.emit("node_fenced", node=c.node_rank, incarnation=previous, left=[], missing=list(c.ranks()),
                             waited_s=0.0, store_moved=True)
            return
        keys = {r: NodeKeys.fenced(c.node_rank, previous, r) for r in c.ranks()}
        started = time.monotonic()
        deadline = started + fence_wait_s(c.node_timeout_s)
        left: list[int] = []
        while True:
            left = [r for r, key in keys.items() if store.check([key])]
            if len(left) == len(keys) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        missing = [r for r in keys if r not in left]
        self.events.emit("node_fenced", node=c.node_rank, incarnation=previous, left=left, missing=missing,
                         waited_s=round(time.monotonic() - started, 3))
        if missing and left:
            self._say(f"ranks {missing} of node {c.node_rank}'s previous agent did not acknowledge their fence "
                      f"within {deadline - started:g} s (gone with their host, or frozen): they cannot join; "
                      "starting the replacements")

    def _listen(self, store: dist.Store, *, hosting: bool) -> None:
        """The liveness connections: the host listens, every other node's agent connects to it."""
        if self._liveness is not None:
            self._liveness.close()
        here = self._endpoint()
        if hosting:
            self._liveness = LivenessServer(store, self._token, here.addr)
        else:
            self._liveness = LivenessClient(store, self._token, here.addr, self.config.node_rank, self.incarnation)

    def poll(self, store: dist.Store, *, hosting: bool) -> list[NodeLost | Fenced]:
        """(Every agent) its own node declared lost while this agent was stopped or cut off; (the store's host)
        the nodes whose agents went silent (its census) or whose liveness connection ended, each incarnation
        once, unless the agents left without them are no majority: then the host is the one cut off."""
        c = self.config
        now = time.monotonic()
        if not hosting and self.incarnation > 0 and now - self._fence_checked_at >= _FENCE_CHECK_EVERY_S:
            self._fence_checked_at = now
            if store.check([NodeKeys.lost(c.node_rank, self.incarnation)]):
                return [Fenced(how=f"no beat for {c.node_timeout_s:g} s: its agent was stopped or cut off")]
        absent = self.succession.poll(store, hosting=hosting, elastic=c.elastic)
        if not hosting:
            return []
        for e in absent:
            if e.node is None and e.spare is not None:  # a waiting spare that went silent is never handed a node
                store.compare_set(NodeKeys.spare(e.spare), "", "gone")
        died = self._liveness.lost() if isinstance(self._liveness, LivenessServer) else []
        lost: list[NodeLost | Fenced] = []
        for node, incarnation in [*died, *((e.node, e.incarnation) for e in absent if e.node is not None)]:
            if node == c.node_rank or (node, incarnation) in self._handled:
                continue
            self._handled.add((node, incarnation))
            # A node that finished (or stopped) and left is silent by then: not a loss (this node's ranks may
            # take a while longer to leave, releasing a group whose peer was cut off).
            if store.check([NodeKeys.done(node)]):
                continue
            if not self.succession.allows_loss(self.succession.index_of_node(node)):
                census = self.succession.census
                here, voters = (len(census.present()), len(census.voters)) if census is not None else (1, 0)
                line = (f"node {node} and most of the job went silent: {here} of the {voters} agents beat here, no "
                        "majority; this node (the store's host) is the one cut off, or stopped: the others move the "
                        f"store on without it, and its ranks are fenced out (exit code {exitcodes.FENCED})")
                return [Fenced(how="the store's host in a minority", line=line)]
            lost.append(NodeLost(node=node, incarnation=incarnation))
        return lost

    def excuse(self, now: float) -> None:
        """This agent was paused until ``now``: the other agents' beats it did not see are no loss."""
        if self.succession.census is not None:
            self.succession.census.excuse(now)

    def handle_loss(self, store: dist.Store, node: int, incarnation: int) -> None:
        """The first agent to claim the loss fails the generation and hands the node to a waiting spare."""
        if claim_loss(store, node, incarnation, by=self.config.node_rank):
            self._hand_on(store, node, incarnation, moved=False)

    def _hand_on(self, store: dist.Store, node: int, incarnation: int, *, moved: bool) -> None:
        """A claimed loss: the generation fails; the node goes to a spare, or an elastic job's survivors take its
        logical ranks; ``moved``: the node's agent hosted the store that moved here (nobody can start it again
        with the same command: with neither a spare nor an elastic width, the job stops to be resumed)."""
        c = self.config
        g = current_generation(store)
        declare_fault(store, g, {"rank": node * c.nproc_per_node, "kind": "node_lost", "node": node,
                                 "time": time.time()}, world_size=c.world_size)
        spare = assign_spare(store, node)
        self.events.emit("node_lost", node=node, incarnation=incarnation, generation=g, spare=spare,
                         timeout_s=c.node_timeout_s, store_host=moved)
        why = "its agent hosted the store" if moved else f"no beat for {c.node_timeout_s:g} s"
        if spare is not None:
            self._say(f"node {node} lost ({why}): handed to spare node agent {spare}")
        elif c.elastic:
            self._shrink(store, node)
        elif moved:
            self._stop(store, f"node {node} lost ({why}) with no spare node and a fixed width: stopping; start the "
                              "job again to resume from its newest checkpoint")
        else:
            self._say(f"node {node} lost ({why}) and no spare node: its ranks' "
                      "peers wait for it to come back (their join timeout), then the job stops")

    def after_move(self, store: dist.Store, moved: Moved, *, supervised: bool) -> None:
        """The store moved: this node registered again in it (the same incarnation), its liveness connection
        to the new host; the new host hands on the nodes lost with the last one (and marks their ranks as
        having run, so that a spare starts them as replacements)."""
        c = self.config
        if self.incarnation > 0:
            key = NodeKeys.incarnation(c.node_rank)
            store.add(key, self.incarnation - int(store.add(key, 0)))
            store.add(NodeKeys.beat(c.node_rank, self.incarnation), 1)
            self._listen(store, hosting=moved.hosting)
        self._handled.clear()
        if not moved.hosting:
            return
        for gone in (moved.previous_host, *moved.lost):
            if gone.node is None:
                continue
            if supervised:
                for r in range(gone.node * c.nproc_per_node, (gone.node + 1) * c.nproc_per_node):
                    store.set(Keys.supervised(r), "moved")
            self._handled.add((gone.node, gone.incarnation))
            self._hand_on(store, gone.node, gone.incarnation, moved=True)

    def _stop(self, store: dist.Store, reason: str) -> None:
        """Stops the job with 75 (every rank reads it at its next join; every agent from its ranks)."""
        request_stop(store, {"rank": -1, "summary": reason, "exit_code": exitcodes.REQUEUE, "step": -1,
                             "generation": current_generation(store)})
        interrupt_for_stop(store, world_size=self.config.world_size)
        self._say(reason)

    def _shrink(self, store: dist.Store, node: int) -> None:
        """An elastic job loses a node and no spare waits: the survivors take its logical ranks (below MIN
        nodes, the job stops with 75 instead)."""
        c = self.config
        try:
            g = shrink(store, c, node)
        except BelowMinimum as e:
            reason = f"{e}: stopping; start the job again to resume from its newest checkpoint"
            request_stop(store, {"rank": -1, "summary": reason, "exit_code": exitcodes.REQUEUE, "step": -1,
                                 "generation": current_generation(store)})
            interrupt_for_stop(store, world_size=c.world_size)
            self.events.emit("width_below_minimum", node=node, min_nodes=c.min_nodes, reason=reason)
            return
        members = members_of(store, g, c.world_size)
        nodes = sorted({m // c.nproc_per_node for m in members})
        self.events.emit("width_request", generation=g, cause="shrink", node=node, members=members, nodes=nodes,
                         width=c.world_size)
        self._say(f"node {node} lost and no spare: the job goes on with node(s) {nodes}, their ranks computing "
                  f"node {node}'s logical ranks too (generation {g})")

    def leave(self, store: dist.Store, *, hosting: bool, until: float | None = None) -> None:
        """This node is done; node 0's agent keeps the store up until every node is (``until``, a monotonic
        time, or :data:`LEAVE_TIMEOUT_S` at most)."""
        c = self.config
        store.set(NodeKeys.done(c.node_rank), "1")
        if not hosting:
            return
        deadline = time.monotonic() + LEAVE_TIMEOUT_S if until is None else until
        timeout_s = max(0.0, deadline - time.monotonic())
        # Nodes that never came (an elastic job below its MAX) are not waited for.
        pending = [n for n in range(c.nnodes) if n != c.node_rank and int(store.add(NodeKeys.incarnation(n), 0)) > 0]
        lost: set[int] = set()
        looked_at = 0.0
        while time.monotonic() < deadline:
            pending = [n for n in pending if not store.check([NodeKeys.done(n)])]
            if not pending:
                break
            if time.monotonic() - looked_at >= _FENCE_CHECK_EVERY_S:
                # A node whose agent went silent meanwhile will never say it is done: not waited for (its ranks
                # are fenced: its incarnation's loss key says so, or this agent's own watch of its beat).
                looked_at = time.monotonic()
                absent = self.succession.poll(store, hosting=True, elastic=False)
                silent = {e.node for e in absent if e.node is not None}
                lost |= {n for n in pending if n in silent or self._current_lost(store, n)}
                pending = [n for n in pending if n not in lost]
            time.sleep(0.05)
        if lost:
            self._say(f"nodes {sorted(lost)} went silent before they finished; not waiting for them")
        if pending:
            self._say(f"nodes {pending} did not finish within {timeout_s:g} s of this one; closing the store")

    @staticmethod
    def _current_lost(store: dist.Store, node: int) -> bool:
        """``node``'s newest incarnation was declared lost (none newer took it over)."""
        incarnation = int(store.add(NodeKeys.incarnation(node), 0))
        return incarnation > 0 and bool(store.check([NodeKeys.lost(node, incarnation)]))

    # ------------------------------------------------------ a spare's wait
    def wait_as_spare(self, store: dist.Store, connect: Callable[[], dist.Store]) -> int:
        index = self.spare_index = register_spare(store)
        here = self._endpoint()
        entry = self.succession.register(store, addr=here.addr, port=here.port, node=None, incarnation=0, spare=index)
        # A spare votes for the store's next host too: it beats under its entry (resilient_train.protocol.succession).
        self._heartbeat = Heartbeat(connect, None, 0, also=(SuccessionKeys.beat(entry.index),))
        self.events.emit("spare_waiting", spare=index)
        self._say(f"spare node agent {index}: waiting for a node to replace")
        return index

    def poll_assignment(self, store: dist.Store, *, stopping: Callable[[], bool]) -> list[NodeAssigned | JobEnded]:
        """A waiting spare: the node handed to it, or the job's end without it (its final state, a rank's stop,
        another node's signal: ``stopping()``)."""
        self.succession.poll(store, hosting=False, elastic=self.config.elastic)  # where the store would move
        now = time.monotonic()
        if now - self._looked_at < _ASSIGNMENT_EVERY_S:
            return []
        self._looked_at = now
        assert self.spare_index is not None
        key = NodeKeys.spare(self.spare_index)
        # check first: a get waits (for a key that is not there yet), so a lost host would be seen only at its end
        value = store.get(key).decode() if store.check([key]) else ""
        if value:
            return [NodeAssigned(node=int(value))]
        if store.check([Keys.FINAL]) or read_stop(store) is not None:
            return [JobEnded(preempted=False)]
        return [JobEnded(preempted=True)] if stopping() else []

    def take(self, node: int) -> None:
        self._say(f"spare node agent {self.spare_index}: taking over node {node}")

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
        if self._liveness is not None:
            self._liveness.close()
