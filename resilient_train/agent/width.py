"""The agents' side of an elastic job (``--nnodes MIN:MAX``): which nodes are in each generation.

The job's logical width is fixed (MAX x ranks per node); its members are the
slots (ranks) of the nodes that live. The agents change them, one generation
at a time (resilient_train.protocol.members: a ``compare_set`` on the next
generation's key, then the generation before is failed):

* **start**: node 0's agent waits until MIN nodes registered (at most
  ``join_timeout_s``), then a last call of ``last_call_s`` for more (ended
  early when all MAX came), and names them generation 0's members. Every
  other agent waits for that list: in it, its ranks start as usual; not in
  it (it came late), it grows the job;
* **shrink**: the agent that claims a lost node's loss, when no spare takes
  it, drops the node's slots: the survivors take its logical ranks over, no
  process starts. Below MIN live nodes the job stops with 75 instead
  (started again, it resumes from its newest checkpoint);
* **grow**: a node that comes back (its agent started again with the same
  command) or comes late adds its slots; its ranks start as replacements and
  heal from a live replica, and the members' logical ranks move back to them.
  The generation in progress is failed for it: at most the step under way is
  computed again.
"""

from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist

from resilient_train.agent.config import AgentConfig
from resilient_train.protocol.members import members_of, propose_members, read_members
from resilient_train.protocol.nodes import NodeKeys
from resilient_train.protocol.store import Keys, current_generation, declare_fault, wait_until

__all__ = ["BelowMinimum", "grow", "is_member", "node_slots", "shrink", "start_members", "wait_for_start"]

_LOOK_S = 0.1


class BelowMinimum(RuntimeError):
    """Fewer nodes than MIN would remain: the job stops (75) and resumes from its newest checkpoint."""


def node_slots(config: AgentConfig, node: int) -> list[int]:
    return list(range(node * config.nproc_per_node, (node + 1) * config.nproc_per_node))


def _nodes(config: AgentConfig, slots: list[int]) -> list[int]:
    return sorted({s // config.nproc_per_node for s in slots})


def _registered(store: dist.Store, nnodes: int) -> list[int]:
    return [n for n in range(nnodes) if int(store.add(NodeKeys.incarnation(n), 0)) > 0]


def start_members(store: dist.Store, config: AgentConfig, say: Callable[[str], None]) -> list[int]:
    """Node 0's agent: generation 0's members, once MIN nodes came and the last call is over."""
    c = config
    deadline = time.monotonic() + c.join_timeout_s
    said = False
    while len(came := _registered(store, c.nnodes)) < c.min_nodes:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"only {len(came)} of the {c.min_nodes} nodes needed (--nnodes "
                               f"{c.min_nodes}:{c.nnodes}) came within {c.join_timeout_s:g} s")
        if not said:
            say(f"waiting for at least {c.min_nodes} of {c.nnodes} nodes (--nnodes {c.min_nodes}:{c.nnodes})")
            said = True
        time.sleep(_LOOK_S)
    last_call = time.monotonic() + c.last_call_s
    while len(came := _registered(store, c.nnodes)) < c.nnodes and time.monotonic() < last_call:
        time.sleep(_LOOK_S)
    members = [s for n in came for s in node_slots(c, n)]
    propose_members(store, 0, members)
    return read_members(store, 0) or members


def wait_for_start(store: dist.Store, config: AgentConfig) -> None:
    """Any other agent: until node 0's agent named generation 0's members."""
    from resilient_train.protocol.members import members_key

    wait_until(lambda: store.check([members_key(0)]), timeout=config.join_timeout_s + config.last_call_s + 60,
               what="node 0 to name the job's first nodes", max_interval=0.2)


def is_member(store: dist.Store, config: AgentConfig, node: int) -> bool:
    """Whether ``node``'s slots are in the current generation."""
    g = current_generation(store)
    return set(node_slots(config, node)) <= set(members_of(store, g, config.world_size))


def _change(store: dist.Store, config: AgentConfig, change: Callable[[list[int]], list[int]],
            fault: dict, timeout_s: float = 60.0) -> int:
    """Proposes ``change(members)`` for the next generation and fails the current one; the generation the
    change takes effect in. Another change proposed first for that generation: it waits for it to take
    effect (the generation moves) and applies its own on top."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = current_generation(store)
        before = members_of(store, g, config.world_size)
        after = change(before)
        if sorted(after) == sorted(before):
            return g
        if propose_members(store, g + 1, after):
            declare_fault(store, g, fault, world_size=config.world_size)
            return g + 1
        wait_until(lambda: current_generation(store) > g, timeout=max(0.001, deadline - time.monotonic()),
                   what=f"the change of generation {g + 1}'s members to take effect")


def shrink(store: dist.Store, config: AgentConfig, node: int) -> int:
    """Drops a lost node's slots from the next generation; raises :class:`BelowMinimum` when fewer than
    MIN nodes would remain. The generation the job continues in."""
    mine = set(node_slots(config, node))

    def without(members: list[int]) -> list[int]:
        left = [s for s in members if s not in mine]
        if len(_nodes(config, left)) < config.min_nodes:
            raise BelowMinimum(f"node {node} lost and no spare: {len(_nodes(config, left))} node(s) left, fewer "
                               f"than --nnodes {config.min_nodes}:{config.nnodes} needs")
        return left

    return _change(store, config, without, {"rank": min(mine), "kind": "node_lost", "node": node,
                                            "time": time.time(), "width": "shrink"})


def _restored(store: dist.Store, config: AgentConfig, timeout_s: float) -> None:
    """Until every member of the current generation stands at its resume step (its local states published): a
    generation failed before that leaves no step to resume from but the start, which the members that did not
    compute it cannot start from."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = current_generation(store)
        if int(store.add(Keys.restored(g), 0)) >= len(members_of(store, g, config.world_size)):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"generation {g} of the job did not start within {timeout_s:g} s")
        time.sleep(_LOOK_S)


def grow(store: dist.Store, config: AgentConfig, node: int) -> int:
    """Adds ``node``'s slots to the next generation (it came back, or came late), once the current one has
    started; the generation its ranks join."""
    _restored(store, config, config.join_timeout_s)
    return _change(store, config, lambda members: sorted({*members, *node_slots(config, node)}),
                   {"rank": node * config.nproc_per_node, "kind": "node_joined", "node": node, "time": time.time(),
                    "width": "grow"})
