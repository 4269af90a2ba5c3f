"""In-rank injection: the supervisor calls :meth:`Injector.at` at each named point."""

from __future__ import annotations

import os
import signal
from typing import Callable

from chaos.faults import Fault, FaultKind, Phase

__all__ = ["InjectedFault", "Injector"]


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws inside a step."""


class Injector:
    """Fires each fault once per run, however many times its step is replayed.

    ``claim(i)`` must return True exactly once per fault index across all the
    run's processes (the supervisor backs it with the store), so a replacement
    rank or a replayed step does not fire the same fault again.
    """

    def __init__(
        self,
        faults: list[Fault],
        *,
        rank: int,
        claim: Callable[[int], bool],
        announce: Callable[[Fault], None] = lambda f: None,
    ) -> None:
        self._mine = [(i, f) for i, f in enumerate(faults) if f.rank == rank]
        self._claim = claim
        self._announce = announce
        self._phases = {f.phase for _, f in self._mine}

    def __bool__(self) -> bool:
        return bool(self._mine)

    def at(self, phase: Phase, step: int) -> None:
        if phase not in self._phases:
            return
        for i, f in self._mine:
            if f.phase == phase and (f.step is None or f.step == step) and self._claim(i):
                self._fire(f, step)

    def _fire(self, fault: Fault, step: int) -> None:
        self._announce(fault)
        if fault.kind is FaultKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind is FaultKind.HANG:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind is FaultKind.SPIN:
            sum(range(10**18))  # one C call: the GIL is never released
        elif fault.kind is FaultKind.BLOCK:
            r, _w = os.pipe()
            os.read(r, 1)  # nothing is ever written
        elif fault.kind is FaultKind.RAISE:
            raise InjectedFault(f"injected exception at step {step}, phase {fault.phase.value}")
