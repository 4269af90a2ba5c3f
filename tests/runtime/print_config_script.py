"""Prints, as one JSON line per rank, the configs this rank builds from the run config and without it.

Run under ``resilient-train run --config FILE``: ``SupervisorConfig.from_run_config`` takes the run config
(RT_RUN_CONFIG) for what the script leaves out; ``pg_timeout_s`` is passed, so the script's value wins over
the file's, and rank 0 says so as a Supervisor given that config would. A config built by its constructor
(``CheckpointConfig(directory="elsewhere")``) takes nothing from the file.
"""

import json
import os

from resilient_train.base.configtree import to_plain
from resilient_train import CheckpointConfig, PreemptionConfig, SupervisorConfig
from resilient_train.rank.config import say_unused_run_config

sup = SupervisorConfig.from_run_config(pg_timeout_s=7.0)
say_unused_run_config(sup)  # what rt.Supervisor(sup) says
print(json.dumps({
    "rank": int(os.environ["RANK"]),
    "run_config": os.environ.get("RT_RUN_CONFIG"),
    "supervisor": to_plain(sup),
    "own_checkpoint": to_plain(CheckpointConfig(directory="elsewhere")),
    "preemption": to_plain(PreemptionConfig()),
}), flush=True)
