"""The parts a run plugs into its loop, built once from its config, in the order they see each hook.

The script's own parts (``sup.add_part``) come first, so they see a generation
before the built-in ones; then chaos (before progress: a rank stopped "at" a
phase has not entered it), progress, CUPTI, disk checkpoints, host snapshots,
the rerun machine and buddy copies. The parts reach the step path through
``stepper``, a callable: the :class:`~resilient_train.rank.stepping.Stepper` is built
on the parts, after them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from chaos import loads_faults
from checkpointing import CheckpointConfig
from monitors import EventLog, ProgressReporter
from resilient_train.protocol import env as envvars
from resilient_train.rank.buddy import BuddyCopies
from resilient_train.rank.config import SupervisorConfig
from resilient_train.rank.disk import DiskCheckpoints, default_checkpoint_config
from resilient_train.rank.errors import UsageError
from resilient_train.rank.local_state import LocalSlots
from resilient_train.rank.mesh import MeshSpec
from resilient_train.rank.parts import ChaosPart, CuptiPart, DiskPart, Part, Parts, ProgressPart, SnapshotPart
from resilient_train.rank.rerun.driver import RerunHooks
from resilient_train.rank.rerun.part import RerunPart
from resilient_train.rank.rerun.save import save_for_stop, shared_table
from resilient_train.rank.stepping import Stepper
from resilient_train.rank.storemirror import Mirror, MirrorPart
from resilient_train.protocol.succession.movable import MovableStore
from resilient_train.rank.train_state import TrainState

__all__ = ["Assembled", "build_parts", "disk_checkpoints"]


@dataclass(kw_only=True)
class Assembled:
    parts: Parts
    disk: DiskCheckpoints | None  # the periodic checkpoints, or the preemption-only ones to resume from
    snapshot: SnapshotPart | None
    rerun: RerunPart | None
    buddy: BuddyCopies | None
    stepper: Stepper


def build_parts(config: SupervisorConfig, state: TrainState, *, added: list[Part], rank: int, world_size: int,
                store: dist.Store, run_dir: Path | None, events: EventLog, device: torch.device,
                comm_device: torch.device, mesh_spec: MeshSpec | None, sharded: bool, slots: LocalSlots,
                generation: Callable[[], int], progress_generation: Callable[[], int],
                group: Callable[[], dist.ProcessGroup | None], stop: Callable[[], float], moved: Callable[[], bool],
                training: Callable[[], bool], elastic: bool = False) -> Assembled:
    """The parts and the Stepper that runs each step with them. ``generation``: the generation the rank is in;
    ``progress_generation``: the one it is in, or heading to once it left one; ``group``, ``stop``,
    ``moved``, ``training``: the Stepper's view of the supervisor (resilient_train.rank.stepping)."""
    c = config
    made: list[Stepper] = []  # the Stepper, made last: the parts reach it through ``stepper()``

    def stepper() -> Stepper:
        return made[0]

    def step() -> int:
        return made[0].ctx.step

    parts: list[Part] = list(added)

    def disk_for(checkpoint: CheckpointConfig) -> DiskCheckpoints:
        return disk_checkpoints(checkpoint, rank=rank, world_size=world_size, store=store, events=events,
                                run_dir=run_dir, mesh_spec=mesh_spec, sharded=sharded,
                                suspended=lambda: stepper().gate.suspended(),
                                width=(lambda: stepper().width) if elastic else None)

    chaos = ChaosPart(loads_faults(os.environ.get(envvars.RT_CHAOS, "")), rank=rank, store=store,
                      run_dir=run_dir, events=events, step=step)
    if chaos:  # before progress: a rank stopped "at" a phase has not entered it
        parts.append(chaos)
    if run_dir is not None:
        # Written by the main thread only, at every phase change: the agent's hang detector reads it.
        parts.append(ProgressPart(ProgressReporter(
            run_dir, rank, cuda_device=device if device.type == "cuda" else None),
            generation=progress_generation))
    if c.cupti is not None:
        parts.append(CuptiPart(c.cupti, events))
    if isinstance(store, MovableStore):  # many nodes: local states copied to the store's next host too
        slots.mirror = Mirror(store.location)
        parts.append(MirrorPart(slots.mirror))
    disk = disk_for(c.checkpoint) if c.checkpoint is not None else None
    if disk is None and run_dir is not None and (run_dir / "checkpoints").is_dir():
        # Checkpoints without a checkpoint config: a preemption's (resilient_train.rank.preempt), to resume from.
        disk = disk_for(default_checkpoint_config(run_dir, every=0, mode="disabled"))
    if disk is not None:
        parts.append(DiskPart(disk, lambda phase, at: stepper().enter(phase, at), steps=c.steps))
    snapshot: SnapshotPart | None = None
    if c.snapshot_every is not None:
        snapshot = SnapshotPart(c.snapshot_every, lambda: stepper().publish_local(state.step, snapshot=True))
        parts.append(snapshot)
    rerun: RerunPart | None = None
    if c.rerun.enabled:
        hooks = RerunHooks(
            exchange=lambda row: shared_table(row, rank=rank, world_size=world_size, device=device),
            rewind=lambda at: stepper().rewind(at),
            save=lambda at: save_for_stop(store, state, at, rank=rank, world_size=world_size,
                                          generation=generation(), run_dir=run_dir,
                                          timeout_s=c.rerun.stop_timeout_s),
            exit=_exit, publish=lambda key, value: store.set(key, value))
        rerun = RerunPart(c.rerun, rank=rank, world_size=world_size, emit=events.emit,
                          hooks=hooks, device_index=device.index if device.type == "cuda" else None)
        state.runtime["rerun"] = rerun.driver.stateful()  # in the published local state and checkpoints
        parts.append(rerun)
    buddy: BuddyCopies | None = None
    if sharded and mesh_spec is not None:
        spec, world = mesh_spec, world_size
        classes = [spec.replica_class(r, world) for r in range(world)]
        if world > 1 and any(classes.count(k) == 1 for k in classes):
            # A shard nobody else holds: its buddy keeps a copy (resilient_train.rank.buddy).
            buddy = BuddyCopies(every=c.buddy_every, rank=rank, world_size=world,
                                payload=lambda: state.shard_state_dict(),
                                publish_local=lambda at: stepper().publish_local(at, snapshot=True),
                                device=comm_device, events=events, corrupt_at=_corrupt_at())
            parts.append(buddy)
    all_parts = Parts(parts)
    made.append(Stepper(state=state, rank=rank, parts=all_parts, rerun=rerun, slots=slots, events=events,
                        world_size=world_size, device=device, chunk_mb=c.chunk_mb, generation=generation,
                        group=group, stop=stop, force_reduction=c.force_reduction, moved=moved, training=training))
    return Assembled(parts=all_parts, disk=disk, snapshot=snapshot, rerun=rerun, buddy=buddy, stepper=made[0])


def disk_checkpoints(config: CheckpointConfig, *, rank: int, world_size: int, store: dist.Store, events: EventLog,
                     run_dir: Path | None, mesh_spec: MeshSpec | None, sharded: bool,
                     suspended: Callable[[], Any], width: Callable[[], Any] | None = None) -> DiskCheckpoints:
    """Sharded state goes to disk in DCP's form, each rank its own chunks: the first member of each replica
    class writes the class's (resilient_train.rank.dcp_state)."""
    return DiskCheckpoints(config, rank=rank, world_size=world_size, store=store, events=events, run_dir=run_dir,
                           sharded=sharded,
                           first_replica=mesh_spec.first_replica(rank, world_size) if mesh_spec is not None else True,
                           suspended=suspended, width=width)


def make_reproducible() -> None:
    """``SupervisorConfig(reproducible=True)``: deterministic algorithms and one intra-op thread."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def preemption_disk(run_dir: Path | None, **kw: Any) -> DiskCheckpoints:
    """The checkpoints a preemption writes to when the run has none configured: RUN_DIR/checkpoints, every save
    synchronous (``kw``: :func:`disk_checkpoints`'s)."""
    if run_dir is None:
        raise UsageError("preempted without a run directory to write the checkpoint to")
    return disk_checkpoints(default_checkpoint_config(run_dir, every=0, mode="disabled"), run_dir=run_dir, **kw)


def _exit(code: int) -> Any:
    raise SystemExit(code)


def _corrupt_at() -> tuple[int, int] | None:
    """Tests: ``RT_TEST_CORRUPT_BUDDY=RANK@STEP`` flips a bit of the buddy copy RANK receives at STEP."""
    spec = os.environ.get(envvars.RT_TEST_CORRUPT_BUDDY, "")
    if not spec:
        return None
    rank, step = spec.split("@")
    return int(rank), int(step)
