"""In-rank injection: the supervisor calls :meth:`Injector.at` at each named point."""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
import time
from typing import Callable

from chaos.faults import VALUE_KINDS, Fault, FaultKind, Phase

__all__ = ["InjectedFault", "Injector"]


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws inside a step. Each fault fires once: two of them are two faults,
    never one bug raised again (``injected``: the supervisor's judge does not hold it against the rank)."""

    injected = True


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
        # Value faults are applied to values (chaos.values), not fired at a phase.
        self._mine = [(i, f) for i, f in enumerate(faults) if f.rank == rank and f.kind not in VALUE_KINDS]
        self._claim = claim
        self._announce = announce
        self._phases = {f.phase for _, f in self._mine}
        self._slow: tuple[Phase, float] | None = None  # (phase, until) while a slow fault lasts

    def __bool__(self) -> bool:
        return bool(self._mine)

    def at(self, phase: Phase, step: int) -> None:
        if phase not in self._phases:
            return
        if self._slow is not None and self._slow[0] == phase:
            if time.time() < self._slow[1]:
                time.sleep(_SLOW_DELAY_S)
            else:
                self._slow = None
        for i, f in self._mine:
            if f.phase != phase or (f.step is not None and f.step != step):
                continue
            if f.not_before is not None and time.time() < f.not_before:
                continue
            if self._claim(i):
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
        elif fault.kind is FaultKind.DEADLOCK:
            threading.Event().wait()  # nobody holds it to set it
        elif fault.kind is FaultKind.TERM:
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind is FaultKind.SLOW:
            self._slow = (fault.phase, time.time() + (fault.duration_s or 2.0))
            time.sleep(_SLOW_DELAY_S)
        elif fault.kind is FaultKind.NETBREAK:
            _break_connections()
        elif fault.kind is FaultKind.RAISE:
            raise InjectedFault(f"injected exception at step {step}, phase {fault.phase.value}")


_SLOW_DELAY_S = 0.05  # per entry to the slowed phase: several times a small job's step


def _break_connections() -> int:
    """Shuts down this process's TCP connections except those to the store (MASTER_PORT).

    What is left is the process group's: both ends see the connection closed,
    as after a broken link, and the next collective fails.
    """
    store_port = int(os.environ.get("MASTER_PORT", "0"))
    broken = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()
            except OSError:
                continue  # a listening socket
            if store_port in (peer[1], sock.getsockname()[1]):
                continue
            sock.shutdown(socket.SHUT_RDWR)
            broken += 1
        except OSError:
            pass
        finally:
            sock.close()  # the duplicate only
    return broken
