"""resilient-train: a fault-tolerant training runtime for PyTorch.

Wrap an existing loop::

    state = resilient_train.TrainState(model=model, optimizer=optimizer)
    resilient_train.Supervisor(resilient_train.SupervisorConfig(steps=1000)).run(train_step, state)
"""

from resilient_train.env import WorkerEnv
from resilient_train.rerun import RerunConfig
from resilient_train.context import StepContext
from resilient_train.errors import GenerationFailed, UsageError
from resilient_train.heartbeat import heartbeat
from resilient_train.mesh import MeshSpec
from resilient_train.preempt import PreemptionConfig
from resilient_train.sharded import ShardedModule
from resilient_train.supervisor import Supervisor, SupervisorConfig
from resilient_train.train_state import Stateful, TrainState

__all__ = [
    "GenerationFailed",
    "MeshSpec",
    "PreemptionConfig",
    "RerunConfig",
    "ShardedModule",
    "StepContext",
    "Stateful",
    "Supervisor",
    "SupervisorConfig",
    "TrainState",
    "UsageError",
    "WorkerEnv",
    "heartbeat",
]

__version__ = "0.1.0"
