"""A wrapped model's call, marked in phases: ``forward`` as it starts, ``backward`` when autograd reaches its output.

``sup.ddp`` and ``sup.sharded`` return wrappers whose forward marks the step's
phases for the monitors and the chaos faults (``Stepper.auto_phase``); this is
that forward, for both.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from checkpointing.tree import leaves

__all__ = ["forward_in_phases"]


def forward_in_phases(module: torch.nn.Module, phase: Callable[[str], None], *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)``, marking ``forward`` now and ``backward`` once a gradient reaches the output."""
    phase("forward")
    out = module(*args, **kwargs)
    if torch.is_grad_enabled():
        first = next((t for t in leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(lambda grad: _backward_starts(phase, grad))
    return out


def _backward_starts(phase: Callable[[str], None], grad: torch.Tensor) -> torch.Tensor:
    phase("backward")
    return grad
