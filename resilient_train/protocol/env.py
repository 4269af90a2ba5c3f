"""Environment variables between the agent and its workers, as typed constants.

The torchrun names (RANK, LOCAL_RANK, WORLD_SIZE, ...) are set too, so a script
written for torchrun runs unmodified under ``resilient-train run``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from resilient_train.base.configtree import RT_RUN_CONFIG  # the run config file the agent wrote (RUN_DIR/run-config.yaml)

__all__ = [
    "RT_AGENT",
    "RT_CHAOS",
    "RT_ELASTIC",
    "RT_GENERATION",
    "RT_JOB_TOKEN",
    "RT_NODE",
    "RT_NODE_INCARNATION",
    "RT_STORE_CALL_S",
    "RT_STORE_EPOCH",
    "RT_STORE_FILE",
    "RT_REPRODUCIBLE",
    "RT_ROLE",
    "RT_RUN_CONFIG",
    "RT_RUN_DIR",
    "WorkerEnv",
    "since_spawn",
]

# torchrun's names.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"

# Ours.
RT_AGENT = "RT_AGENT"  # "1" when a resilient-train agent hosts the store and respawns ranks
RT_RUN_DIR = "RT_RUN_DIR"  # where events.jsonl, final/ and checkpoints go
RT_GENERATION = "RT_GENERATION"  # the generation the worker was spawned into
RT_ROLE = "RT_ROLE"  # "initial" or "replacement"
RT_CHAOS = "RT_CHAOS"  # JSON list of faults to inject (see chaos.faults)
RT_SPAWNED_AT = "RT_SPAWNED_AT"  # wall-clock time the agent started (or assigned) the worker
RT_NODE = "RT_NODE"  # many nodes: the node the worker's agent serves
RT_NODE_INCARNATION = "RT_NODE_INCARNATION"  # many nodes: that agent's incarnation of the node (resilient_train.rank.fence)
RT_STORE_FILE = "RT_STORE_FILE"  # many nodes: where the worker's agent says where the store moved (succession)
RT_STORE_EPOCH = "RT_STORE_EPOCH"  # many nodes: the epoch of the store at MASTER_ADDR:MASTER_PORT (0: node 0's)
RT_STORE_CALL_S = "RT_STORE_CALL_S"  # many nodes: a store call's deadline (the host may stop without closing)
RT_JOB_TOKEN = "RT_JOB_TOKEN"  # the job's secret: its keys in the store live under a namespace derived from it
RT_TEST_CORRUPT_BUDDY = "RT_TEST_CORRUPT_BUDDY"  # tests: "RANK@STEP" flips a bit of the buddy copy RANK receives at STEP
RT_REPRODUCIBLE = "RT_REPRODUCIBLE"  # "1" in the agent's environment: supervisor.reproducible in the run config (chaos runner)
RT_FORCE_REDUCTION = "RT_FORCE_REDUCTION"  # "1" in the agent's environment: supervisor.force_reduction (benchmarks)
RT_ELASTIC = "RT_ELASTIC"  # "1": an elastic job (--nnodes MIN:MAX): WORLD_SIZE logical ranks on the live processes


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """What a worker learns from its environment."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    under_agent: bool
    run_dir: str | None
    generation: int
    replacement: bool
    elastic: bool = False  # --nnodes MIN:MAX: a generation's members are the live slots (resilient_train.rank.elastic)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or MASTER_PORT in os.environ

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "WorkerEnv":
        env = os.environ if environ is None else environ
        return cls(
            rank=int(env.get(RANK, "0")),
            local_rank=int(env.get(LOCAL_RANK, "0")),
            world_size=int(env.get(WORLD_SIZE, "1")),
            master_addr=env.get(MASTER_ADDR, "127.0.0.1"),
            master_port=int(env.get(MASTER_PORT, "0")),
            under_agent=env.get(RT_AGENT) == "1",
            run_dir=env.get(RT_RUN_DIR) or None,
            generation=int(env.get(RT_GENERATION, "0")),
            replacement=env.get(RT_ROLE) == "replacement",
            elastic=env.get(RT_ELASTIC) == "1",
        )


def since_spawn() -> float | None:
    """Seconds from the agent starting this worker to now (None without an agent)."""
    spawned = os.environ.get(RT_SPAWNED_AT)
    return round(time.time() - float(spawned), 3) if spawned else None
