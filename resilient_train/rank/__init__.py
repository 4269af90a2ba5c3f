"""The rank side: the Supervisor's lifecycle inside each rank, and the step path, state and recovery below it.

It speaks to the agent side (``resilient_train.agent``) only through ``resilient_train.protocol`` (the store,
its keys, the environment): the two sides never import each other (tests/test_layout.py).
"""

__all__: list[str] = []
