"""Prints, as one JSON line per rank, the configs this rank builds with and without explicit values.

Run under ``resilient-train run --config FILE``: what the script leaves out comes from the run config
(RT_RUN_CONFIG); ``pg_timeout_s`` is passed explicitly, so the script's value wins over the file's.
"""

import json
import os

from monitors.configtree import to_plain
from resilient_train import CheckpointConfig, PreemptionConfig, SupervisorConfig

sup = SupervisorConfig(pg_timeout_s=7.0)
print(json.dumps({
    "rank": int(os.environ["RANK"]),
    "run_config": os.environ.get("RT_RUN_CONFIG"),
    "supervisor": to_plain(sup),
    "own_checkpoint": to_plain(CheckpointConfig(directory="elsewhere")),
    "preemption": to_plain(PreemptionConfig()),
}), flush=True)
