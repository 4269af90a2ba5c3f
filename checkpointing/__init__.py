"""Checkpoints in the torch.distributed.checkpoint format with an atomic commit protocol.

Single process: :func:`write_state`, :func:`read_state`, :func:`diff_states`.
Many ranks, asynchronous: :class:`CheckpointManager` with :class:`CheckpointConfig`.
"""

from checkpointing.config import AsyncMode, CheckpointConfig, InFlightPolicy
from checkpointing.diff import diff_states
from checkpointing.errors import EXIT_DISK_FULL, DiskFullError, is_disk_full
from checkpointing.lifecycle import SaveHandle, SavePhase
from checkpointing.manager import CheckpointManager, NoCheckpointError
from checkpointing.manifest import CheckpointError, Manifest, verify_checkpoint
from checkpointing.state_files import read_state, write_state

__all__ = [
    "AsyncMode",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "DiskFullError",
    "EXIT_DISK_FULL",
    "InFlightPolicy",
    "Manifest",
    "NoCheckpointError",
    "SaveHandle",
    "SavePhase",
    "diff_states",
    "is_disk_full",
    "read_state",
    "verify_checkpoint",
    "write_state",
]
