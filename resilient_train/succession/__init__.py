"""No single point of failure: the coordination store moves when its host is lost (docs/design.md).

Node 0's agent hosts the store at the start; every other agent serves a
standby store from the start too, on an address and port of its own. The
store's state is soft (``protocol``: every key family and what a move does
to it), so when its host is lost the agents of the last generation move to
the first successor alive, which opens a fresh store in the same secret
namespace, but only once a majority of them came (``protocol.majority``):
two sides of a partition never both go on.

==================  ============================================================
``protocol``        the keys, the agents' registry, the succession, the majority
``location``        where the store is now (an endpoint and its epoch), shared
``movable``         a store whose calls end by a deadline and follow a move
``mirror``          the ranks' local states, copied to the first successor
==================  ============================================================

The agent's side of a move is :mod:`resilient_train.agent.succession`; a
rank's (it follows its own agent) is :mod:`resilient_train.succession.follow`.
"""
