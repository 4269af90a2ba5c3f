"""A batch that is not a function of the step, found when the step is computed again.

Recovery and the rerun machine rest on one assumption: computing step N
again, from boundary N's state (the model, the RNGs, the data position in
``TrainState``), feeds the model the same inputs. A batch drawn with
``next(iterator)`` from an iterator the state does not hold breaks it: the
replayed step trains on another batch, the run differs from its fault-free
twin, and a re-run compares results of different data.

So every call of the model inside a step (its forward pre-hook) leaves a
fingerprint of its inputs: per tensor, its shape, its dtype and two float64
numbers (the sum, and the sum weighted by row: one reduction pass, computed
where the tensor lives, never read back unless the step is computed again).
When ``(step, data_rank)`` is computed again in this process (a step redone
after a recovery, a re-run in place, a peer's re-run as the same rank), its
calls are compared with the first computation's, and the first that differs
stops the job with one line naming the step (:class:`UsageError`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any, Callable

import torch

from checkpointing.tree import children, leaves
from resilient_train.rank.errors import UsageError

__all__ = ["BatchFingerprints", "NOT_A_FUNCTION", "fingerprint"]

KEEP = 64  # computations remembered: a step further back is redone unchecked
_MAX_ITEMS = 64  # the inputs looked at per call (nested lists and dicts included)
_MAX_WEIGHTED = 1 << 16  # a 1-D input up to this size is weighted element by element

NOT_A_FUNCTION = ("step {step} fed the model other inputs when it was computed again (rank {rank}, as rank "
                  "{data_rank}, call {call} of the model in the step): the batch is not a function of the step "
                  "(a next(iterator) the train state does not hold?); compute it from ctx.step and "
                  "ctx.data_rank, or keep the loader's position in TrainState(extra=...)")


def fingerprint(args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """The inputs of one call: plain values as they are, tensors as (shape, dtype, device fingerprint or None)."""
    out: list[Any] = []
    for x in itertools.islice(leaves([args, kwargs], children=_call_children), _MAX_ITEMS):
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype, _digest(x)))
        elif x is None or isinstance(x, (bool, int, float, str)):
            out.append(x)
        else:
            out.append(type(x).__qualname__)
    return out


def _call_children(x: Any) -> list[tuple[Any, Any]] | None:
    """A call's inputs as a tree whose dicts hold each key's name before its value, by name (keyword order
    is the caller's whim)."""
    if isinstance(x, dict):
        keys = reversed(sorted(x, key=str, reverse=True))  # two keys of one name: the later one first
        return [(k, y) for k in keys for y in (str(k), x[k])]
    return children(x)


def _digest(t: torch.Tensor) -> torch.Tensor | None:
    if type(t) is not torch.Tensor or t.is_meta or t.layout is not torch.strided or t.is_complex():
        return None  # a subclass (DTensor: its reductions are collectives), a sparse or meta tensor: shape only
    x = t.detach()
    if x.dim() >= 2:  # one sum per row (a sample, for a batch-first input): no copy, whatever the strides
        rows = x.sum(dim=tuple(range(1, x.dim())), dtype=torch.float64)
    elif x.numel() <= _MAX_WEIGHTED:
        rows = x.reshape(-1).to(torch.float64)
    else:
        rows = x.sum(dtype=torch.float64).reshape(1)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.float64, device=rows.device)
    return torch.stack([rows.sum(), rows.dot(weights)])


def _same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, tuple) and isinstance(y, tuple):
            if x[:2] != y[:2] or (x[2] is None) != (y[2] is None):
                return False
            # The bits: a NaN in the batch is the same NaN when the batch is the same.
            if x[2] is not None and not torch.equal(x[2].view(torch.int64), y[2].to(x[2].device).view(torch.int64)):
                return False
        elif x != y or type(x) is not type(y):
            return False
    return True


class BatchFingerprints:
    """The fingerprints of the model's inputs, per ``(step, data_rank)`` computed in this process."""

    def __init__(self, model: torch.nn.Module, *, rank: int, emit: Callable[..., Any],
                 training: Callable[[], bool]) -> None:
        self._rank, self._emit, self._training = rank, emit, training
        self._seen: OrderedDict[tuple[int, int], list[list[Any]]] = OrderedDict()
        self._key: tuple[int, int] | None = None
        self._record: list[list[Any]] = []
        self._calls = 0  # calls of the model in the current computation
        self._handle = model.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    def begin(self, step: int, data_rank: int) -> None:
        key = (step, data_rank)
        self._key, self._calls = key, 0
        record = self._seen.pop(key, None)
        self._record = record if record is not None else []
        self._seen[key] = self._record  # the newest last
        while len(self._seen) > KEEP:
            self._seen.popitem(last=False)

    def _on_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._key is None or not self._training():
            return None  # outside a step (on_new_group, after the run): not a step's batch
        mine = fingerprint(args, kwargs)
        call, self._calls = self._calls, self._calls + 1
        if call >= len(self._record):
            self._record.append(mine)  # the first computation (or one that goes further than it did)
        elif not _same(self._record[call], mine):
            step, data_rank = self._key
            self._emit("batch_not_replayable", rank=self._rank, step=step, data_rank=data_rank, call=call)
            raise UsageError(NOT_A_FUNCTION.format(step=step, rank=self._rank, data_rank=data_rank, call=call))
        return None

    def close(self) -> None:
        self._handle.remove()
        self._seen.clear()
