"""The named sections of a training step, and their fixed codes in a progress slot."""

from __future__ import annotations

from enum import Enum

__all__ = [
    "COLLECTIVE_SECTIONS",
    "COMPUTE_SECTIONS",
    "LONG_SECTIONS",
    "SECTIONS",
    "Section",
    "section_code",
]


class Section(str, Enum):
    """Where a rank's main thread is. The order fixes the codes in the slot file."""

    STARTUP = "startup"
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    ALL_REDUCE = "all-reduce"
    OPTIMIZER = "optimizer"
    CHECKPOINT = "checkpoint"
    BETWEEN_STEPS = "between-steps"
    RECOVERY = "recovery"
    LOAD = "load"


SECTIONS: tuple[str, ...] = tuple(s.value for s in Section)

# Sections that legitimately take much longer than a step; they get their own timeout.
LONG_SECTIONS: frozenset[str] = frozenset({"startup", "load", "checkpoint", "recovery"})
# Sections where a rank waits for its peers: a hang there is usually a peer's fault.
COLLECTIVE_SECTIONS: frozenset[str] = frozenset({"all-reduce"})
# Sections whose time is the rank's own work (straggler scores use these).
COMPUTE_SECTIONS: tuple[str, ...] = ("data", "forward", "backward", "optimizer")

_CODES: dict[str, int] = {}
for _i, _s in enumerate(Section):
    _CODES[_s.value] = _i
    _CODES[_s] = _i  # type: ignore[index]  # Enum members hash by name, not by value


def section_code(section: str | Section) -> int:
    """The slot code of ``section``; ``ValueError`` for an unknown name."""
    try:
        return _CODES[section]
    except KeyError:
        raise ValueError(f"unknown section {section!r}; expected one of {', '.join(SECTIONS)}") from None
