"""Healing: ranks that lost the replicated state copy it from a live replica, point to point.

Only the ranks that need the state receive it, each from one source (the plan
spreads targets over the holders), so a lost rank costs one copy of the state
over the network, whatever the world size. A source sends a header (the
state's plain data, with each tensor's shape, dtype and device) and then the
tensors, packed into buffers of at most ``bucket_mb`` per dtype so the
transfer is a handful of sends however many parameters the model has, and
never holds a second copy of the whole state.

The order of a restore is here too: :func:`restore_live` (every rank of the
generation, from its own copy, a live replica or a buddy's host copy, in one
order on every rank) and :func:`restore_from_disk` (the checkpoint every rank
agreed to load, or the start).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from chaos import Phase
from checkpointing.tree import map_leaves
from monitors.events import EventLog
from resilient_train.rank.disk import DiskCheckpoints
from resilient_train.rank.generation import JoinError, ResumePlan, ResumeSource
from resilient_train.rank.local_state import LocalSlots, decode_local, encode_local
from resilient_train.rank.snapshot import HostSnapshot, TensorRef, flatten, unflatten
from resilient_train.rank.stepping import Stepper
from resilient_train.rank.train_state import TrainState

__all__ = ["HostCopies", "heal_order", "receive_state", "restore_from_disk", "restore_live", "send_state"]

BUCKET_MB = 64.0


def _buckets(layout: list[tuple[tuple[int, ...], torch.dtype, str]], bucket_bytes: int) -> list[list[int]]:
    """Groups tensor indices by dtype into runs of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype, _) in enumerate(layout):
        by_dtype.setdefault(dtype, []).append(i)
    out: list[list[int]] = []
    for dtype, indices in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        run: list[int] = []
        size = 0
        for i in indices:
            n = _numel(layout[i][0]) * dtype.itemsize
            if run and size + n > bucket_bytes:
                out.append(run)
                run, size = [], 0
            run.append(i)
            size += n
        if run:
            out.append(run)
    return out


_REF = "__rt_tensor__"


def _plain(skeleton: Any) -> Any:
    """The skeleton with its tensor references as plain dicts (the header is read with weights_only)."""
    return map_leaves(lambda node: {_REF: node.index} if isinstance(node, TensorRef) else node, skeleton)


def _is_ref(node: Any) -> bool:
    return isinstance(node, dict) and len(node) == 1 and _REF in node


def _refs(plain: Any) -> Any:
    return map_leaves(lambda node: TensorRef(int(node[_REF])) if _is_ref(node) else node, plain, is_leaf=_is_ref)


def send_state(state: Any, dst: int, *, device: torch.device) -> int:
    """Sends ``state`` (a state dict) to ``dst``; returns the bytes sent."""
    skeleton, tensors = flatten(state)
    layout = [(tuple(t.shape), t.dtype, t.device.type) for t in tensors]
    header = encode_local({"skeleton": _plain(skeleton),
                           "layout": [(s, str(d).removeprefix("torch."), k) for s, d, k in layout]})
    blob = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    dist.send(torch.tensor([blob.numel()], dtype=torch.int64, device=device), dst)
    dist.send(blob, dst)
    sent = blob.numel()
    for run in _buckets(layout, int(BUCKET_MB * 2**20)):
        if len(run) == 1 and tensors[run[0]].device == device and tensors[run[0]].is_contiguous():
            flat = tensors[run[0]].detach().reshape(-1)
        else:
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in run])
        dist.send(_wire(flat), dst)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_state(src: int, *, device: torch.device) -> tuple[Any, int]:
    """Receives what :func:`send_state` sends from ``src``; returns the state and the bytes received."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    blob = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(blob, src)
    # The header is plain data from a peer of the same job, read with weights_only.
    header = decode_local(blob.cpu().numpy().tobytes())
    layout = [(tuple(s), getattr(torch, d), k) for s, d, k in header["layout"]]
    out: list[torch.Tensor | None] = [None] * len(layout)
    received = blob.numel()
    for run in _buckets(layout, int(BUCKET_MB * 2**20)):
        dtype = layout[run[0]][1]
        sizes = [_numel(layout[i][0]) for i in run]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.recv(_wire(flat), src)
        received += flat.numel() * flat.element_size()
        for i, piece in zip(run, torch.split(flat, sizes)):
            target = "cpu" if layout[i][2] == "cpu" else device
            out[i] = piece.view(layout[i][0]).to(target, copy=True)
    return unflatten(_refs(header["skeleton"]), out), received  # type: ignore[arg-type]


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no bool type; the bytes travel the same.
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Copy(Protocol):
    def state(self) -> dict[str, Any]: ...


class HostCopies(Protocol):
    """The buddy copies a restore reads (:class:`resilient_train.rank.buddy.BuddyCopies`)."""

    def own_copy(self, step: int) -> _Copy: ...

    def copy_of(self, owner: int, step: int) -> _Copy: ...

    def resumed(self, step: int) -> None: ...


def heal_order(plan: ResumePlan) -> list[tuple[int, int, bool]]:
    """The transfers of a live restore as ``(target, source, from a buddy's host copy)``, in the one order every
    rank runs them: by target, so a rank that both serves and receives never waits on a peer that waits on it.
    A buddy holder serves its host copy; a live source, what it holds."""
    return sorted([(t, s, False) for t, s in plan.heal_from.items()] +
                  [(t, h, True) for t, h in plan.buddy_from.items()])


def restore_live(plan: ResumePlan, *, state: TrainState, rank: int, stepper: Stepper, slots: LocalSlots,
                 device: torch.device, events: EventLog, snapshot: HostSnapshot | None, buddy: HostCopies | None,
                 adopt_record: Callable[[], None] | None) -> None:
    """Boundary ``plan.step`` from live state: this rank's own host copy, a live replica, a buddy's copy.

    ``device``: where the transfers go (the communication device); ``adopt_record``: a replacement's rerun
    machine takes over the newest record, after the local state is loaded. The plan names ranks by slot;
    the transfers go to and from their places in the generation's group (``stepper.width``), and the local
    state loaded is that of the last logical rank this rank computes (its own, in a fixed-width job).
    """
    width = stepper.width
    step = plan.step
    assert step is not None
    stepper.enter(Phase.HEAL.value, step)
    if rank in plan.from_snapshot:
        if snapshot is not None and snapshot.step == step:
            state.load_replicated(snapshot.replicated())
        else:
            assert buddy is not None
            state.load_shard_state(buddy.own_copy(step).state())
    sent = received = 0
    source_of: int | None = None
    for target, source, from_buddy in heal_order(plan):
        if source == rank:
            assert not from_buddy or buddy is not None
            payload = buddy.copy_of(target, step).state() if from_buddy else state.shard_state_dict()  # type: ignore[union-attr]
            sent += send_state(payload, width.group_rank(target), device=device)
        elif target == rank:
            stepper.live = None  # torn until the whole state arrived
            healed, received = receive_state(width.group_rank(source), device=device)
            state.load_shard_state(healed)
            source_of = source
    state.load_local(slots.read_decoded(stepper.hosted[-1], step))
    if adopt_record is not None:
        adopt_record()
    assert state.step == step, (state.step, step)
    if buddy is not None:
        buddy.resumed(step)
    stepper.restored(step)
    if sent or received or rank in plan.from_snapshot:
        events.emit("healed", rank=rank, step=step, generation=plan.generation, bytes_sent=sent,
                    bytes_received=received, from_rank=source_of,
                    from_buddy=rank in plan.buddy_from, from_own_copy=rank in plan.from_snapshot)


def restore_from_disk(plan: ResumePlan, *, state: TrainState, rank: int, stepper: Stepper,
                      disk: DiskCheckpoints | None, store: dist.Store, events: EventLog, buddy: HostCopies | None,
                      timeout: float, steps: int) -> None:
    """The checkpoint every rank agreed to load (``ResumeSource.DISK``), or the start if there is none (one
    past the run's last step, ``steps``, is refused: resilient_train.rank.disk)."""
    loaded, logical = None, None
    if disk is not None:
        stepper.enter("load", state.step)
        stepper.live = None
        loaded, logical = disk.load_agreed(state, store, plan.generation, timeout=timeout, steps=steps)
    if loaded is None and plan.source is ResumeSource.DISK:
        raise JoinError("no live replica holds a recoverable step and there is no checkpoint to fall back on")
    if loaded is not None:
        if buddy is not None:
            buddy.resumed(loaded)  # copies of later boundaries belong to steps that are redone
        events.emit("resumed_from_disk", rank=rank, step=loaded, generation=plan.generation)
        if rank == 0:
            print(f"resilient-train: resumed from the checkpoint of step {loaded}", file=sys.stderr, flush=True)
    stepper.publish_start(state.step, logical)
    stepper.restored(state.step)
