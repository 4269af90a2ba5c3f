"""The store's host is lost: this agent moves with the job's store (resilient_train.agent.succession).

What the loop does with a ``MoveStore`` decision: find or open the next
store, point every connection of the agent at it, tell this node's ranks
where it is (they follow their own agent: resilient_train.rank.storefollow),
register this node there again, and, as the new host, hand the lost host's
node on (a spare, or an elastic job's survivors). No store opening is one
more event for the loop to decide (``NoMajority``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

from monitors import EventLog
from resilient_train.agent import events as ev
from resilient_train.agent.membership import Membership
from resilient_train.protocol import env as E
from resilient_train.agent.clock import PauseClock
from resilient_train.agent.storehost import StoreHost
from resilient_train.agent.succession import NotMoved
from resilient_train.protocol.succession.location import announce, call_timeout_s

__all__ = ["announce_path", "move_store", "store_env"]

_PAUSED_S = 30.0  # a pause this recent explains a lost store


def announce_path(run_dir: Path) -> Path:
    """Where this agent tells its ranks the store's endpoint (one file per agent: the run directory may be
    every node's)."""
    return run_dir / ".store" / f"{socket.gethostname()}-{os.getpid()}.json"


def store_env(host: StoreHost, path: Path, node_timeout_s: float) -> dict[str, str]:
    """A rank's store, as its agent knows it now: the endpoint, its epoch, where a move is announced."""
    here = host.endpoint
    return {E.MASTER_ADDR: here.addr, E.MASTER_PORT: str(here.port), E.RT_STORE_EPOCH: str(here.epoch),
            E.RT_STORE_FILE: str(path), E.RT_STORE_CALL_S: str(call_timeout_s(node_timeout_s))}


def move_store(error: str, *, host: StoreHost, membership: Membership, path: Path, events: EventLog,
               say: Callable[[str], None], supervised: bool, clock: PauseClock) -> ev.NoMajority | None:
    """Moves this agent to the store's next host; the event to decide when no store opened.

    An agent that was paused just before (it was stopped, its host frozen) and finds nobody to move with
    cannot tell a job that ended, or went on without its node, from a host that died: it is fenced (94),
    never the one to stop the job (75)."""
    assert host.succession is not None
    known = host.succession.known
    lost_at = host.address
    paused = clock.paused_within(_PAUSED_S)
    result = host.succession.move()
    clock.restart()  # the move's wait was no pause of this agent
    if isinstance(result, NotMoved):
        return ev.NoMajority(error=error, reason=result.reason, host_dead=result.host_dead and not paused)
    host.moved(result.endpoint, hosting=result.hosting)
    announce(path, result.endpoint)
    previous = result.previous_host.name
    new_host = "this agent" if result.hosting else _name_of(known, result.endpoint)
    events.emit("store_moved", epoch=result.endpoint.epoch, endpoint=str(result.endpoint), hosting=result.hosting,
                previous_host=previous, present=list(result.present), voters=list(result.voters),
                waited_s=round(result.waited_s, 3), lost=[e.name for e in result.lost])
    say(f"lost the store on {lost_at} ({previous}: {error[:80]}); it moved to {new_host} ({result.endpoint}, epoch "
        f"{result.endpoint.epoch}) with {len(result.present)} of the {len(result.voters)} agents of the last "
        "generation: the job goes on")
    membership.after_move(host.store, result, supervised=supervised)  # the new host hands the lost nodes on
    return None


def _name_of(known, endpoint) -> str:  # type: ignore[no-untyped-def]
    for e in (known.agents if known is not None else ()):
        if (e.addr, e.port) == (endpoint.addr, endpoint.port):
            return e.name
    return str(endpoint)
