"""No single point of failure: the coordination store moves when its host is lost (docs/design.md).

Node 0's agent hosts the store at the start; every other agent serves a
standby store from the start too, on an address and port of its own. The
store's state is soft (``rules``: every key family and what a move does
to it), so when its host is lost the agents of the last generation move to
the first successor alive, which opens a fresh store in the same secret
namespace, but only once a majority of them came (``rules.majority``):
two sides of a partition never both go on.

==================  ============================================================
``rules``           the keys, the agents' registry, the succession, the majority
``location``        where the store is now (an endpoint and its epoch), shared
``movable``         a store whose calls end by a deadline and follow a move
``census``          the host's census: which agents still beat, and a majority
==================  ============================================================

The agent's side of a move is :mod:`resilient_train.agent.succession`; a
rank's (it follows its own agent) is :mod:`resilient_train.rank.storefollow`, and
the ranks' local states, copied to the first successor, :mod:`resilient_train.rank.storemirror`.
"""
