"""Who is in a generation of an elastic job: one key per generation, written before the generation begins.

The agents decide the membership (resilient_train.agent.width): node 0's at the
start (the nodes that came within the last call), the one that claims a lost
node's loss when no spare takes it (a shrink), the one whose node comes back or
joins late (a grow). Each writes ``members/{g+1}`` with a ``compare_set``
(one change per generation: a second waits for the first to take effect) and
only then fails generation ``g``, so every rank that leaves ``g`` finds the
membership of ``g+1`` in place. A generation with no key (a rank replaced in
place, an exception) keeps its predecessor's members: the newest settled plan
before it says who they were.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from resilient_train.protocol.store import Keys

__all__ = ["members_key", "members_of", "propose_members", "read_members"]


def members_key(g: int) -> str:
    return f"rt/width/members/{g}"


def read_members(store: dist.Store, g: int) -> list[int] | None:
    key = members_key(g)
    if not store.check([key]):
        return None
    return sorted(int(m) for m in json.loads(store.get(key)))


def propose_members(store: dist.Store, g: int, members: list[int]) -> bool:
    """Sets generation ``g``'s members unless someone did first; True when these are they."""
    proposed = json.dumps(sorted(members))
    return store.compare_set(members_key(g), "", proposed).decode() == proposed


def members_of(store: dist.Store, g: int, width: int) -> list[int]:
    """Generation ``g``'s members: its own key, else the newest settled plan's before it, else every slot."""
    own = read_members(store, g)
    if own is not None:
        return own
    for k in range(g - 1, -1, -1):
        own = read_members(store, k)
        if own is not None:
            return own
        key = Keys.outcome(k)
        if store.check([key]):
            value = store.get(key)
            if value.decode() != Keys.FAILED:
                plan_width = json.loads(value).get("width")
                if plan_width is not None:
                    return sorted(int(m) for m in plan_width["members"])
    return list(range(width))
