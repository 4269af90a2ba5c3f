"""Value faults: wrong numbers instead of dead processes (for the rerun state machine's tests).

* ``nan``: one rank's loss becomes NaN, once per run (a transient glitch).
* ``bitflip``: a bit flips in one rank's local gradient on every step from
  ``step`` on, in the process that first reaches it only (broken hardware: a
  replacement process is healthy).
* ``spike``: the batch of ``(step, rank)`` makes the loss spike, on whichever
  process computes that batch, every time (bad data: it reproduces anywhere).

The supervisor applies them at two points: the loss a step reports
(``nan``, ``spike``) and the local gradients before the all-reduce
(``bitflip``). ``claim(i)`` is the injector's once-per-run claim of fault ``i``.
"""

from __future__ import annotations

from typing import Callable

import torch

from chaos.faults import Fault, FaultKind

__all__ = ["SPIKE_FACTOR", "ValueFaults"]

SPIKE_FACTOR = 1000.0  # what a spiking batch does to the loss (and so to the gradients)
_FLIP_BIT = 30  # the top exponent bit of a float32: a small value becomes huge


class ValueFaults:
    def __init__(
        self,
        faults: list[Fault],
        *,
        rank: int,
        claim: Callable[[int], bool],
        announce: Callable[[Fault], None] = lambda f: None,
    ) -> None:
        self._nan = [(i, f) for i, f in enumerate(faults) if f.kind is FaultKind.NAN and f.rank == rank]
        self._flip = [(i, f) for i, f in enumerate(faults) if f.kind is FaultKind.BITFLIP and f.rank == rank]
        self._spike = [f for f in faults if f.kind is FaultKind.SPIKE]  # any process computing that batch
        self._armed: set[int] = set()  # bit flips this process has claimed: they stay with it
        self._claim = claim
        self._announce = announce

    def __bool__(self) -> bool:
        return bool(self._nan or self._flip or self._spike)

    def corrupt_loss(self, loss: torch.Tensor, *, step: int, data_rank: int) -> torch.Tensor:
        for f in self._spike:
            if f.rank == data_rank and (f.step is None or f.step == step):
                self._announce(f)
                loss = loss * SPIKE_FACTOR
        for i, f in self._nan:
            if (f.step is None or f.step == step) and self._claim(i):
                self._announce(f)
                loss = loss * float("nan")  # the gradients turn NaN too, as after a real overflow
        return loss

    def corrupt_grads(self, grads: list[torch.Tensor], *, step: int) -> None:
        for i, f in self._flip:
            if f.step is not None and step < f.step:
                continue
            if i not in self._armed:
                if not self._claim(i):
                    continue  # another process (the one this replaces) had the broken hardware
                self._armed.add(i)
                self._announce(f)
            _flip_bit(grads)

    @property
    def flipping(self) -> bool:
        return bool(self._armed)


def _flip_bit(grads: list[torch.Tensor]) -> None:
    """Flips the top exponent bit of the largest element of the first non-zero float32 gradient."""
    for g in grads:
        if g.dtype is not torch.float32 or not g.numel():
            continue
        flat = g.view(-1)
        idx = int(flat.abs().argmax())
        if flat[idx] == 0:
            continue
        bits = flat[idx : idx + 1].view(torch.int32)
        bits.bitwise_xor_(1 << _FLIP_BIT)
        return
