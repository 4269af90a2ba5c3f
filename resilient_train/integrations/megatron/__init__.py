"""Megatron-Core jobs across faults (the ``megatron`` extra).

* :mod:`.layout`: Megatron's rank layout as data, and who heals whom (pure; no megatron import).
* :mod:`.parallel`: ``parallel_state`` torn down and rebuilt on each generation's group, with a
  census of the groups alive; :mod:`.part` plugs it into the supervisor (:func:`attach`).
* :mod:`.rerun`: Megatron's rerun vocabulary, exit codes and fault injector in this runtime's terms.
* ``checkpointing.megatron_dist``: checkpoints through ``dist_checkpointing`` with this runtime's commit.

Importing this package imports no megatron; :func:`attach` and :class:`MegatronParallel` do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from resilient_train.integrations.megatron.layout import Coords, HealAssignment, ParallelLayout

if TYPE_CHECKING:
    from resilient_train.integrations.megatron.parallel import MegatronConfig, MegatronParallel
    from resilient_train.rank.supervisor import Supervisor

__all__ = ["Coords", "HealAssignment", "MegatronConfig", "MegatronParallel", "ParallelLayout", "attach"]


def attach(sup: "Supervisor", config: "MegatronConfig | None" = None) -> "MegatronParallel":
    """Megatron's parallel state under ``sup``: rebuilt on each generation, torn down before its group goes.

    Build the model with ``pg_collection=returned.groups`` and pass it to
    ``returned.track(model)``. Call before ``sup.run``.
    """
    from resilient_train.rank.errors import UsageError
    from resilient_train.integrations.megatron.parallel import MegatronConfig, MegatronParallel
    from resilient_train.integrations.megatron.part import MegatronPart

    config = config or MegatronConfig()
    if config.tensor * config.pipeline * config.context > 1:
        # The supervisor reduces gradients and heals over the whole world: right only when every rank is a
        # data-parallel replica. The layout and the rebuild support more; the step and the plan do not yet.
        raise UsageError("under the supervisor the Megatron integration supports tensor = pipeline = context = 1 "
                         "today (the gradient reduction and the heal plan are data-parallel only)")
    parallel = MegatronParallel(config, rank=sup.env.rank, world_size=sup.env.world_size)
    sup.add_part(MegatronPart(parallel, device=sup.device, emit=sup.events.emit))
    return parallel


def __getattr__(name: str) -> Any:
    if name in ("MegatronConfig", "MegatronParallel"):
        from resilient_train.integrations.megatron import parallel

        return getattr(parallel, name)
    raise AttributeError(name)
