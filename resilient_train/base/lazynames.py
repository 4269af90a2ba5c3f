"""A package's names imported when first used (PEP 562), for the packages whose imports are heavy.

``resilient_train`` and ``checkpointing`` name classes whose modules pull in
torch.distributed.checkpoint and torch.distributed.tensor (about 1 s of a
2-core machine): the node agent, which imports them only for their configs,
would pay that at every start.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["lazy_names"]


def lazy_names(package: str, table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``table`` maps each lazy name to its module."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted([*namespace, *table])

    return __getattr__, __dir__
