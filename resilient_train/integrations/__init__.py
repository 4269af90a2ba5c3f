"""Integrations with heavy libraries, each behind its extra and imported lazily.

``resilient_train.integrations.megatron``: Megatron-Core (the ``megatron`` extra).
Importing this package imports none of them.
"""

__all__: list[str] = []
