"""The train state in DCP's form: what a disk checkpoint of sharded state holds, and loading it on any layout.

A job with ``sup.sharded`` checkpoints its model and optimizer as
``torch.distributed.checkpoint.state_dict.get_state_dict`` gives them: keyed by
parameter name (FQN), each sharded tensor a DTensor, so each rank writes only
its own chunks (:mod:`checkpointing.shards`). The manifest says so
(``extras["state_form"] == "dcp"``). Loading builds the same form on the
current layout (another world size, another mesh, or no mesh at all: a
data-parallel model) and the checkpoint is read straight into it, each rank
reading the chunks that overlap what it holds; ``set_state_dict`` then loads
it, param groups included. The final state (``final/``) is the same form,
gathered, so a checkpoint and a final state compare key for key.

``get_state_dict`` creates the state of an optimizer that has none (and no
gradients) by stepping it with a learning rate of 0. That is harmless when
the state is about to be loaded; at a save it happens only to a stateless
optimizer whose gradients were dropped (plain SGD: a step of 0 changes no
bit). The buffers are not sized ahead for an optimizer that has not stepped
yet (:func:`saveable`): that step would give Adam a first step it never took.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch

from resilient_train.rank.sharded import ShardedModule
from resilient_train.rank.train_state import TrainState

__all__ = ["DCP_FORM", "FORM_KEY", "Suspend", "dcp_state_dict", "dcp_targets", "load_dcp_state", "saveable"]

FORM_KEY = "state_form"  # in a checkpoint's extras
DCP_FORM = "dcp"

Suspend = Callable[[], ContextManager[Any]]  # the commit gate kept out of an optimizer step DCP makes


def _module(state: TrainState) -> torch.nn.Module:
    model = state.model
    return model.module if isinstance(model, ShardedModule) else model


def saveable(state: TrainState) -> bool:
    """False while ``get_state_dict`` would step the optimizer to create its state (it never stepped)."""
    opt = state.optimizer
    return opt is None or bool(opt.state) or any(p.grad is not None for g in opt.param_groups for p in g["params"])


def dcp_targets(state: TrainState, suspended: Suspend) -> dict[str, Any]:
    """The live model and optimizer in DCP's form (DTensors on the current mesh): what a load fills in place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    module = _module(state)
    if state.optimizer is None:
        return {"model": get_model_state_dict(module)}
    with suspended():
        model_sd, optim_sd = get_state_dict(module, state.optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def dcp_state_dict(state: TrainState, suspended: Suspend) -> dict[str, Any]:
    """What a checkpoint of sharded state holds: :func:`dcp_targets` and the replicated objects' state."""
    sd = dcp_targets(state, suspended)
    if state.replicated:
        sd["replicated"] = {name: obj.state_dict() for name, obj in state.replicated.items()}
    return sd


def load_dcp_state(state: TrainState, loaded: dict[str, Any], suspended: Suspend) -> None:
    """Loads a checkpoint read into :func:`dcp_targets` (and the replicated objects' state)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    module = _module(state)
    with suspended():
        if state.optimizer is None:
            set_model_state_dict(module, loaded["model"])
        else:
            if "optimizer" not in loaded:
                raise ValueError("the checkpoint holds no optimizer state, and this job has an optimizer")
            set_state_dict(module, state.optimizer, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optimizer"])
    for name, obj in state.replicated.items():
        obj.load_state_dict(loaded["replicated"][name])
