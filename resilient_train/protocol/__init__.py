"""The protocol both sides speak: the coordination store and its keys, the environment the agent hands its
workers, the nodes of a job, shutdown, the job's secret, a generation's members, the store's succession.

The rank side (``resilient_train.rank``) and the agent side (``resilient_train.agent``) import it; it imports
neither (tests/test_layout.py).
"""

__all__: list[str] = []
