"""One step, as the supervisor runs it: compute, vote, commit, and the rerun flow before any commit.

The :class:`Stepper` owns what a step touches besides the user's code: the
gradient reducers (``ctx.average_gradients()`` and each DDP's hook), the
commit gate, the guard over buffers a forward pass changes, the publication
of the next boundary's local state (just before the vote goes out), and
``live``, the boundary the rank's replicated state is at (None while the
optimizer is changing it). The supervisor owns generations and recoveries.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from chaos import Phase
from chaos.faults import RECOVERY_PHASES
from monitors.events import EventLog
from resilient_train.rank.commit import BufferGuard, CommitGate, MicroStepDone, StepMeasured, StepRejected
from resilient_train.rank.context import StepContext, StepFn
from resilient_train.rank.elastic.ordered import OrderedSum
from resilient_train.rank.elastic.width import Width
from resilient_train.rank.errors import GenerationFailed
from resilient_train.rank.local_state import LocalSlots, as_peer, encode_local, same_local
from resilient_train.rank.misuse import MisuseChecks
from resilient_train.rank.parts import Part, Parts
from resilient_train.rank.readout import LossReadout
from resilient_train.rank.reducer import GradientReducer, ReducerHooks
from resilient_train.rank.rerun.driver import Outcome
from resilient_train.rank.rerun.part import ComputeMode, RerunPart
from resilient_train.rank.train_state import TrainState

__all__ = ["Stepper"]

_PHASE_ORDER = {p.value: i for i, p in enumerate(
    [Phase.BETWEEN_STEPS, Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.ALL_REDUCE, Phase.OPTIMIZER])}
_STEP_PHASES = frozenset(p.value for p in Phase if p not in RECOVERY_PHASES)


class Stepper:
    def __init__(self, *, state: TrainState, rank: int, parts: Parts, rerun: RerunPart | None,
                 slots: LocalSlots, events: EventLog, world_size: int, device: torch.device, chunk_mb: float,
                 generation: Callable[[], int], group: Callable[[], dist.ProcessGroup | None],
                 moved: Callable[[], bool], training: Callable[[], bool], stop: Callable[[], float] = lambda: 0.0,
                 force_reduction: bool = False) -> None:
        self.state, self.parts, self.rerun = state, parts, rerun
        self.ctx = StepContext(self, rank=rank, world_size=world_size, device=device)
        self._slots, self._events, self._device, self._chunk_mb = slots, events, device, chunk_mb
        self._force = force_reduction
        self._generation, self._group, self._moved, self._training = generation, group, moved, training
        self.rank = rank
        self.misuse = MisuseChecks(state=state, world_size=world_size, step=lambda: self.ctx.step,  # issue 25 item 3
                                   generation=generation, group=group, reducers=lambda: self.gate.reducers,
                                   new_reducer=lambda m: self.new_reducer(m.parameters()), emit=events.emit,
                                   rank=rank, training=training)
        self.gate = CommitGate(world_size=world_size, group=group, device=device, vote=self._vote, moved=moved,
                               decide=self._decide, before_update=self._before_update,
                               on_optimizer=lambda: self.auto_phase(Phase.OPTIMIZER.value), stop=stop,
                               unreduced=self.misuse.check_unreduced)
        self._stop = stop
        self._hooks = [state.optimizer.register_step_pre_hook(self.gate.pre_hook)] if state.optimizer else []
        self.guard = BufferGuard(state.model)
        self.loss = LossReadout()
        self._reducer: GradientReducer | None = None  # ctx.average_gradients(), made on first use
        self._mode = ComputeMode.COMMIT
        self._warned_late_local = False
        self.live: int | None = state.step  # the boundary the replicated state is at; None: torn or unknown
        self.published: tuple[int, dict[str, Any]] | None = None
        # The generation's layout (resilient_train.rank.elastic): the logical ranks this process computes, and the
        # ordered average of their gradients (None: the plain all-reduce).
        self.width = Width.full(world_size)
        self._ordered: OrderedSum | None = None
        self.gate.micro_done = lambda logical: self.publish_local(self.ctx.step + 1, logical=logical, current=False)
        self.initial: Callable[[int], bool] = lambda logical: False  # sup.seed's RNGs for a logical rank

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self.misuse.close()

    # ----------------------------------------------- what the context asks
    @property
    def generation(self) -> int:
        return self._generation()

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group()

    def enter(self, phase: str, step: int) -> None:
        """A phase starts (the step's or the runtime's own): a failed generation is noticed, the parts see it."""
        if self._moved() and phase in _STEP_PHASES:
            raise GenerationFailed(f"generation {self._generation()} was declared failed")
        self.parts.on_phase(phase, step)

    def on_loss(self, loss: torch.Tensor, step: int, data_rank: int) -> torch.Tensor:
        return self.parts.on_loss(loss, step, data_rank)

    def set_width(self, width: Width, *, ordered: bool) -> None:
        """This generation's layout: who computes which logical rank; ``ordered``: the layout-independent
        average (on any layout, and the only one where a process computes several logical ranks)."""
        assert ordered or width.identity, "a process computing several logical ranks needs the ordered average"
        self.width = width
        self.gate.world_size = width.size
        self._ordered = OrderedSum(width.by_group_rank(), width.group_rank(self.rank)) if ordered else None

    @property
    def hosted(self) -> list[int]:
        """The logical ranks this process computes in this generation, in order."""
        return self.width.hosted(self.rank)

    def layout(self) -> OrderedSum | None:
        return self._ordered

    # ------------------------------------------------------------ reducers
    def new_reducer(self, params: Any, *, bucket_mb: float | None = None) -> GradientReducer:
        # Only parts that look at gradients get them: the views cost a little on every step.
        looks = any(type(p).before_chunk is not Part.before_chunk for p in self.parts.parts)
        hooks = ReducerHooks(vote=self._vote, stop=self._stop, group=self._group, layout=self.layout,
                             before_chunk=(lambda views, last: self.parts.before_chunk(views, last, self.ctx.step))
                             if looks else None)
        reducer = GradientReducer(list(params), hooks, bucket_mb=bucket_mb or self._chunk_mb, force=self._force)
        reducer.micro = self.gate.micro  # made inside a micro-step (ctx.average_gradients' first call): keeps too
        self.gate.reducers.append(reducer)
        return reducer

    def reduce_gradients(self) -> None:
        if self._reducer is None:
            self._reducer = self.new_reducer(self.state.model.parameters())
        self._reducer.reduce_all()

    def abort_reductions(self, reason: str) -> None:
        """The generation moved (watcher thread): a rank waiting on a reduction is released at once."""
        error = GenerationFailed(reason)
        for reducer in self.gate.reducers:
            reducer.abort(error)

    def reset_reducers(self) -> None:
        """Drops every reducer's pending work (it holds the failed group)."""
        for reducer in self.gate.reducers:
            reducer.forget()

    # ----------------------------------------------------------------- step
    def run_step(self, step_fn: StepFn, step: int) -> None:
        """One step, committed (or skipped by the rerun policy); re-run flows happen before the commit.

        A process computing several logical ranks runs a micro-step for each but the last (its gradients
        kept, its local state published at the gate, then it ends before the optimizer), and the last one
        in full: its reduction averages every logical rank's contribution, in logical order."""
        hosted = self.hosted
        if hosted != [self.rank]:
            for reducer in self.gate.reducers:
                reducer.new_round()
            for logical in hosted[:-1]:
                self._micro(step_fn, step, logical)
            self.rewind(step, hosted[-1])
            self._compute(step_fn, step, hosted[-1], ComputeMode.COMMIT)
            return
        mode = ComputeMode.COMMIT
        while True:
            try:
                self._compute(step_fn, step, self.rank, mode)
                return
            except StepRejected as rejected:
                assert self.rerun is not None, "a rejected step without the rerun machine"
                self.rewind(step)
                outcome = self.rerun.resolve(rejected, step, lambda as_rank: self._measure(step_fn, step, as_rank))
                self.rewind(step)
                if outcome is Outcome.SKIP:
                    self.publish_local(step + 1)  # the batch is skipped: the boundary's state carries over
                    return
                mode = ComputeMode.ACCEPT

    def end_boundary(self) -> None:
        """The step ended (``state.step`` advanced): what was published at its vote must be this boundary."""
        self.live = self.state.step
        now = self.state.local_state_dict()
        if self.published is None or self.published[0] != self.state.step or not same_local(now, self.published[1]):
            self.publish_local(self.state.step, logical=self.hosted[-1])
            if not self._warned_late_local:
                self._warned_late_local = True
                self._events.emit("local_state_changed_after_reduction", rank=self.rank, step=self.state.step)
        self.guard.mark()
        self.misuse.step_end()

    def rewind(self, step: int, as_rank: int | None = None) -> None:
        """Back to boundary ``step`` before its commit: gradients dropped, ``as_rank``'s local state loaded."""
        self.discard_gradients()
        self.guard.restore()
        sd = self._slots.read_decoded(self.rank if as_rank is None else as_rank, step)
        if as_rank is not None and as_rank != self.rank:
            sd = as_peer(sd, self._device)
        self.state.load_local(sd)

    def discard_gradients(self) -> None:
        for p in self.state.model.parameters():
            p.grad = None

    def publish_local(self, step: int, *, snapshot: bool = False, logical: int | None = None,
                      current: bool = True) -> bytes:
        """This rank's local state as boundary ``step``'s, in the store; returns the payload.

        ``snapshot``: into a snapshot slot, which outlives the two ring slots (a host snapshot's or a
        buddy copy's boundary); the ring's record of what was published at the vote is left as it is.
        ``logical``: under that logical rank's keys (the one computed: ``ctx.data_rank``, by default the
        process's own); ``current=False``: a micro-step's, not the state the process goes on from.
        """
        sd = self.state.local_state_dict()
        sd["step"] = step
        payload = encode_local(sd)
        self._slots.publish(self.rank if logical is None else logical, step, payload, snapshot=snapshot)
        if not snapshot and current:
            self.published = (step, sd)
        return payload

    def publish_start(self, step: int, loaded: dict[int, dict[str, Any]] | None = None) -> None:
        """Boundary ``step``'s local state of every logical rank this process computes, as it starts them: as a
        checkpoint holds it (``loaded``, by logical rank), else as ``initial(logical)`` seeds it, else as this
        process's own state is (a logical rank nobody computed before, unseeded)."""
        hosted = self.hosted
        if hosted == [self.rank]:
            self.publish_local(step)
            return
        own = self.state.local_state_dict()
        for x in hosted:
            if loaded is not None and x in loaded:
                self.state.load_local(loaded[x])
            else:
                self.state.load_local({**own, "step": step})
                if x != self.rank and self.initial(x):  # its own logical rank keeps what the script did after it
                    self.state.reseeded()
            self.publish_local(step, logical=x, current=x == hosted[-1])

    def restored(self, step: int) -> None:
        """The state stands at boundary ``step`` after a restore (its local state is in the store already)."""
        self.live = step
        self.published = (step, self.state.local_state_dict())
        self.gate.begin_step()
        self.discard_gradients()
        self.guard.mark()
        self.misuse.arm()  # a DDP the script builds in the next step is found (issue 25 item 3)

    def auto_phase(self, phase: str) -> None:
        """A phase the runtime sees by itself (DDP's forward and backward, the reduction, the commit).

        Only forward moves: a script that marks its phases with ``ctx.enter`` is not overridden.
        """
        if self._training() and _PHASE_ORDER.get(phase, 0) > _PHASE_ORDER.get(self.ctx.phase.value, 0):
            self.ctx.enter(phase)

    # -------------------------------------------------------------- inside
    def _compute(self, step_fn: StepFn, step: int, as_rank: int, mode: ComputeMode) -> Any:
        self.ctx.step, self.ctx.data_rank = step, as_rank
        self._mode = mode
        self.misuse.begin(step, as_rank)  # the batch's fingerprints, compared if it was computed before
        if self.rerun is not None:
            self.rerun.begin(mode)
        self.gate.begin_step()
        self.ctx.phase = Phase.BETWEEN_STEPS
        self.auto_phase(Phase.DATA.value)
        out = step_fn(self.ctx)
        self.gate.commit()  # the optimizer never stepped (or there is none): the step still needs its vote
        self.ctx.data_rank = self.rank
        self.loss.note(out)
        return out

    def _micro(self, step_fn: StepFn, step: int, logical: int) -> None:
        """Computes ``logical``'s batch of ``step`` up to the gate, from its own local state; keeps its
        gradients for the step's reduction."""
        self.rewind(step, logical)
        for reducer in self.gate.reducers:
            reducer.micro = logical
        self.gate.micro = logical
        try:
            self._compute(step_fn, step, logical, ComputeMode.COMMIT)
        except MicroStepDone:
            pass
        finally:
            for reducer in self.gate.reducers:
                reducer.micro = None
            self.gate.micro = None
            self.ctx.data_rank = self.rank

    def _measure(self, step_fn: StepFn, step: int, as_rank: int) -> Any:
        """Computes ``step`` as ``as_rank`` up to its commit (a re-run); returns its result."""
        self.rewind(step, as_rank)
        try:
            self._compute(step_fn, step, as_rank, ComputeMode.MEASURE)
        except StepMeasured:
            pass
        finally:
            self.ctx.data_rank = self.rank
        assert self.rerun is not None
        return self.rerun.result()

    def _vote(self) -> float:
        """This rank's vote on the step, cast just before it goes out in the reduction."""
        self.auto_phase(Phase.ALL_REDUCE.value)
        if self._moved():
            return 0.0  # abstain: the generation is over, nobody may commit
        vote = self.rerun.vote() if self.rerun is not None else 1.0
        if self._mode is not ComputeMode.MEASURE and not math.isnan(vote):
            self.publish_local(self.ctx.step + 1, logical=self.ctx.data_rank)
        return vote

    def _decide(self, total: float) -> None:
        if self.rerun is not None:
            self.rerun.at_gate(self.ctx.step, total)
        elif math.isnan(total):
            raise GenerationFailed("the commit vote came back NaN (a collective aborted mid-way)")

    def _before_update(self) -> None:
        self.live = None  # from here until the step ends, the state is between two boundaries
        self.parts.before_update()
