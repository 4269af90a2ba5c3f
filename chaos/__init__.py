"""Faults as data, injection points, and (later) scenarios and verdicts."""

from chaos.faults import Fault, FaultKind, Phase, dumps_faults, loads_faults
from chaos.inject import InjectedFault, Injector

__all__ = ["Fault", "FaultKind", "InjectedFault", "Injector", "Phase", "dumps_faults", "loads_faults"]
