"""Read-only views of a run: events, heartbeats, straggler scores, metrics sinks.

Of the runtime, only ``resilient_train.base`` is imported here: the runtime composes these pieces.
Ranks write progress (``ProgressReporter``; on a GPU it also times sections
with CUDA events, ``device_timing``); the node agent polls a ``NodeMonitor``
(or ``HangDetector`` and ``StragglerDetector`` directly), takes hung ranks'
stacks (``stacks``) and keeps the computed timeouts across jobs and in
checkpoints (``persist``). ``cupti_kernels`` is the optional NVRx backend.
``dashboard`` is the live straggler and recovery page (and its export); it is
not imported here: its server needs the ``dashboard`` extra.
"""

from monitors.control import StragglerControl, read_control, write_control
from monitors.events import EventLog, read_events
from monitors.hang import HangDetector
from monitors.hangconfig import HangConfig
from monitors.hangverdict import Hang
from monitors.metrics import MetricsSink, PrometheusSink, Sample, TensorBoardSink
from monitors.node import MetricsConfig, MonitorConfig, MonitorResult, NodeMonitor, max_local_ranks
from monitors.progress import ProgressReporter, ProgressSnapshot, StepRecord
from monitors.progressreader import ProgressReader
from monitors.sections import SECTIONS, Section
from monitors.straggler import (
    RankScore,
    StragglerConfig,
    StragglerDecision,
    StragglerDetector,
    StragglerReport,
)

__all__ = [
    "EventLog",
    "Hang",
    "HangConfig",
    "HangDetector",
    "MetricsConfig",
    "MetricsSink",
    "MonitorConfig",
    "MonitorResult",
    "NodeMonitor",
    "ProgressReader",
    "ProgressReporter",
    "ProgressSnapshot",
    "PrometheusSink",
    "RankScore",
    "SECTIONS",
    "Sample",
    "Section",
    "StepRecord",
    "StragglerConfig",
    "StragglerControl",
    "StragglerDecision",
    "StragglerDetector",
    "StragglerReport",
    "TensorBoardSink",
    "read_control",
    "read_events",
    "max_local_ranks",
    "write_control",
]
