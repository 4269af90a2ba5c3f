"""Megatron's CUDA RNG tracker as rank-local state.

Megatron forks named CUDA generators for dropout inside tensor-parallel
regions (``get_cuda_rng_tracker().fork()``); their states are outside torch's
default generator, which the supervisor captures on its own. Given to the
train state as its ``extra``, this object makes them part of every step's
rank-local state, so a replayed step draws the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RngTrackerState", "seed_rng_tracker"]


def seed_rng_tracker(seed: int, *, tp_rank: int = 0) -> None:
    """Megatron's ``model_parallel_cuda_manual_seed``, with the ranks given (no parallel state needed)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)


class RngTrackerState:
    """``state_dict``/``load_state_dict`` over Megatron's tracked CUDA RNG states (each a byte tensor)."""

    def state_dict(self) -> dict[str, Any]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return {name: state.clone() for name, state in get_cuda_rng_tracker().get_states().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states({name: torch.as_tensor(s).clone() for name, s in state.items()})
