"""resilient-train: a fault-tolerant training runtime for PyTorch.

Wrap an existing loop::

    state = resilient_train.TrainState(model=model, optimizer=optimizer)
    config = resilient_train.SupervisorConfig.from_run_config(steps=1000)  # the run's config, these steps
    resilient_train.Supervisor(config).run(train_step, state)

Every config class is here: ``RunConfig`` composes the sections (README, "Configuration"); a config is what its
constructor was given, and ``SupervisorConfig.from_run_config`` is where a rank takes the run's.
"""

from typing import TYPE_CHECKING

from resilient_train.base.lazynames import lazy_names

__all__ = [
    "AgentConfig",
    "AsyncMode",
    "CheckpointConfig",
    "CuptiConfig",
    "DashboardConfig",
    "GenerationFailed",
    "HangConfig",
    "InFlightPolicy",
    "MeshSpec",
    "MetricsConfig",
    "MonitorConfig",
    "OnGenuine",
    "OutputConfig",
    "PreemptionConfig",
    "RerunConfig",
    "RerunMode",
    "RunConfig",
    "ShardedModule",
    "StepContext",
    "Stateful",
    "StragglerConfig",
    "Supervisor",
    "SupervisorConfig",
    "TrainState",
    "UsageError",
    "WorkerEnv",
    "heartbeat",
]

__version__ = "0.1.0"

# Every name is imported when first used (PEP 562): the node agent, which imports this package for its
# configs, then loads neither the Supervisor nor what it pulls in (torch.distributed.tensor, DCP: about 1 s of
# a 2-core machine at every start), and a rank does not load the agent.
_LAZY = {
    "AgentConfig": "resilient_train.agent.config",
    "AsyncMode": "checkpointing",
    "CheckpointConfig": "checkpointing",
    "CuptiConfig": "monitors.cupti_kernels",
    "DashboardConfig": "monitors.dashboard.server",
    "GenerationFailed": "resilient_train.rank.errors",
    "HangConfig": "monitors.hangconfig",
    "InFlightPolicy": "checkpointing",
    "MeshSpec": "resilient_train.rank.mesh",
    "MetricsConfig": "monitors",
    "MonitorConfig": "monitors",
    "OnGenuine": "resilient_train.rank.rerun",
    "OutputConfig": "resilient_train.agent.workerio",
    "PreemptionConfig": "resilient_train.rank.preempt",
    "RerunConfig": "resilient_train.rank.rerun",
    "RerunMode": "resilient_train.rank.rerun",
    "RunConfig": "resilient_train.runconfig",
    "ShardedModule": "resilient_train.rank.sharded",
    "Stateful": "resilient_train.rank.train_state",
    "StepContext": "resilient_train.rank.context",
    "StragglerConfig": "monitors.straggler",
    "Supervisor": "resilient_train.rank.supervisor",
    "SupervisorConfig": "resilient_train.rank.supervisor",
    "TrainState": "resilient_train.rank.train_state",
    "UsageError": "resilient_train.rank.errors",
    "WorkerEnv": "resilient_train.protocol.env",
    "heartbeat": "resilient_train.rank.heartbeat",
}

if TYPE_CHECKING:
    from checkpointing import AsyncMode, CheckpointConfig, InFlightPolicy
    from monitors import MetricsConfig, MonitorConfig
    from monitors.cupti_kernels import CuptiConfig
    from monitors.dashboard.server import DashboardConfig
    from monitors.hangconfig import HangConfig
    from monitors.straggler import StragglerConfig
    from resilient_train.protocol.env import WorkerEnv
    from resilient_train.rank.rerun import OnGenuine, RerunConfig, RerunMode
    from resilient_train.rank.context import StepContext
    from resilient_train.rank.errors import GenerationFailed, UsageError
    from resilient_train.rank.heartbeat import heartbeat
    from resilient_train.rank.mesh import MeshSpec
    from resilient_train.rank.preempt import PreemptionConfig
    from resilient_train.rank.sharded import ShardedModule
    from resilient_train.rank.supervisor import Supervisor, SupervisorConfig
    from resilient_train.rank.train_state import Stateful, TrainState
    from resilient_train.agent.workerio import OutputConfig
    from resilient_train.agent.config import AgentConfig
    from resilient_train.runconfig import RunConfig

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
