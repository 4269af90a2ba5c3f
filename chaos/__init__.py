"""Faults as data, injection points, scenarios and verdicts.

In ranks (imported by the runtime, kept light): :mod:`chaos.faults`, :mod:`chaos.inject`,
:mod:`chaos.values`. Driving jobs from outside: :mod:`chaos.schedule`, :mod:`chaos.scenario`,
:mod:`chaos.runner` (``run_scenario``), :mod:`chaos.matrix`, :mod:`chaos.testing` (pytest),
:mod:`chaos.cli` (``resilient-train chaos``).
"""

from chaos.faults import Fault, FaultKind, Phase, dumps_faults, loads_faults, parse_faults, validate_faults
from chaos.inject import InjectedFault, Injector

__all__ = [
    "Fault", "FaultKind", "InjectedFault", "Injector", "Phase", "dumps_faults", "loads_faults", "parse_faults",
    "validate_faults",
]
