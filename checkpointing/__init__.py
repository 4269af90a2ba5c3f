"""Checkpoints in the torch.distributed.checkpoint format with an atomic commit protocol.

Single process: :func:`write_state`, :func:`read_state`, :func:`diff_states`.
Many ranks, asynchronous: :class:`CheckpointManager` with :class:`CheckpointConfig`.
"""

from typing import TYPE_CHECKING

from resilient_train.base.lazynames import lazy_names

from checkpointing.config import AsyncMode, CheckpointConfig, InFlightPolicy

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
    "StorageError",
    "UnwritableError",
    "diff_states",
    "is_disk_full",
    "read_state",
    "storage_fault",
    "verify_checkpoint",
    "write_state",
]

# Imported when first named: torch.distributed.checkpoint (DCP) costs 0.7 s to import, and a process that only
# reads a config (the node agent) never needs it.
_LAZY = {
    "diff_states": "checkpointing.diff",
    "EXIT_DISK_FULL": "checkpointing.errors",
    "DiskFullError": "checkpointing.errors",
    "is_disk_full": "checkpointing.errors",
    "StorageError": "checkpointing.errors",
    "UnwritableError": "checkpointing.errors",
    "storage_fault": "checkpointing.errors",
    "SaveHandle": "checkpointing.lifecycle",
    "SavePhase": "checkpointing.lifecycle",
    "CheckpointManager": "checkpointing.manager",
    "NoCheckpointError": "checkpointing.manager",
    "CheckpointError": "checkpointing.manifest",
    "Manifest": "checkpointing.manifest",
    "verify_checkpoint": "checkpointing.manifest",
    "read_state": "checkpointing.state_files",
    "write_state": "checkpointing.state_files",
}

if TYPE_CHECKING:
    from checkpointing.diff import diff_states
    from checkpointing.errors import (EXIT_DISK_FULL, DiskFullError, StorageError, UnwritableError, is_disk_full,
                                      storage_fault)
    from checkpointing.lifecycle import SaveHandle, SavePhase
    from checkpointing.manager import CheckpointManager, NoCheckpointError
    from checkpointing.manifest import CheckpointError, Manifest, verify_checkpoint
    from checkpointing.state_files import read_state, write_state

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
