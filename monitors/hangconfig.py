"""The hang detector's configuration (``monitors.hang`` in the run config): its timeouts and how they are computed.

What each timeout means, and the evidence that applies it, is :mod:`monitors.hang`'s doc.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from monitors.sections import COLLECTIVE_SECTIONS, SECTIONS
from resilient_train.base.configfile import (
    MAX_COUNT, MAX_SECONDS, kind, require_bool, require_int, require_number, require_strs,
)
from resilient_train.base.configtree import renamed

__all__ = ["MAX_SAFETY_FACTOR", "HangConfig"]

MAX_SAFETY_FACTOR = 100.0


@renamed(timeouts="timeouts_s", min_timeout="idle_timeout_s", default_timeout="idle_timeout_s",
         min_timeout_s="idle_timeout_s", default_timeout_s="idle_timeout_s",
         startup_timeout="startup_timeout_s", long_section_timeout="long_section_timeout_s",
         longest_timeout="longest_timeout_s")
@dataclass(kw_only=True)
class HangConfig:
    enabled: bool = True  # off: no rank is ever taken for hung
    timeouts_s: dict[str, float] = field(default_factory=dict)  # per section, seconds: fixed, never computed
    computed: bool = True  # timeouts computed from the durations observed (else the floors below)
    safety_factor: float = 5.0  # a computed timeout: this times the longest duration seen for the section
    min_observations: int = 10  # times a section is seen, across ranks, before its timeout is computed
    stopped_timeout_s: float = 3.0  # a rank stopped (SIGSTOP, a debugger) while its agent runs
    idle_timeout_s: float = 60.0  # a rank whose processes use no CPU (a deadlock, a lost I/O), at least
    busy_timeout_s: float = 1800.0  # a rank that computes (an evaluation, a long step) or waits on other nodes, at least
    startup_timeout_s: float = 300.0  # before a rank's first progress, and in "startup"
    long_section_timeout_s: float = 600.0  # in "load", "checkpoint" and "recovery"
    collective_sections: tuple[str, ...] = tuple(sorted(COLLECTIVE_SECTIONS))  # a rank in these waits on peers

    def __post_init__(self) -> None:
        require_bool(self.enabled, "hang.enabled")
        require_bool(self.computed, "hang.computed")
        if not isinstance(self.timeouts_s, dict):
            raise ValueError(f"hang.timeouts_s must be a mapping of section to seconds, got {kind(self.timeouts_s)}")
        unknown = sorted(str(s) for s in set(self.timeouts_s) - set(SECTIONS))
        if unknown:
            raise ValueError(f"hang.timeouts_s: unknown sections {unknown}; expected some of {list(SECTIONS)}")
        for section, t in self.timeouts_s.items():
            require_number(t, f"hang.timeouts_s.{section}", above=0, high=MAX_SECONDS)
        for name in ("stopped_timeout_s", "idle_timeout_s", "busy_timeout_s", "startup_timeout_s",
                     "long_section_timeout_s"):
            require_number(getattr(self, name), f"hang.{name}", above=0, high=MAX_SECONDS)
        require_number(self.safety_factor, "hang.safety_factor", above=0, high=MAX_SAFETY_FACTOR)
        require_int(self.min_observations, "hang.min_observations", low=1, high=MAX_COUNT)
        self.collective_sections = require_strs(self.collective_sections, "hang.collective_sections",
                                                choices=SECTIONS)

    @property
    def longest_timeout_s(self) -> float:
        """The longest timeout this configuration grants any section; a computed one never exceeds it."""
        return max(self.idle_timeout_s, self.busy_timeout_s, self.startup_timeout_s, self.long_section_timeout_s,
                   *self.timeouts_s.values())
