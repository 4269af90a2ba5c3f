"""The rerun flow inside a rank: validate, re-run in place, re-run on a peer, act.

Every value a decision rests on is shared with every rank first (one small
all-reduce of a table with a row per rank), and every rank applies the same
rules of :mod:`resilient_train.rank.rerun.policy` to the same table, so every rank
takes the same decision without another round of agreement.

The flow runs before the step is committed (its result is known before the
optimizer may apply it), so the state is still at the step's boundary. The
supervisor supplies the hooks: ``exchange`` (the all-reduce of the table),
``recompute(as_rank)`` (compute the step as ``as_rank``: its data and its RNG,
up to its commit), ``rewind`` (back to this rank's own boundary local state),
``save`` (the last good state, for a stop) and ``exit``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, NoReturn

from resilient_train.rank.rerun.machine import Classification, RerunMachine, RerunState
from resilient_train.rank.rerun.policy import (
    EXIT_RERUN_ELSEWHERE, EXIT_VALIDATION_FAILED, OnGenuine, RerunConfig, peer_for, same_result,
    swap_assignment,
)
from resilient_train.rank.rerun.validators import StepResult, Verdict

__all__ = ["Outcome", "RankExcluded", "RerunDriver", "RerunHooks", "RECORD_KEY"]

RECORD_KEY = "rt/rerun/record"  # the newest decision record, for replacements (the run's memory, not a step's)
_REASONS = ["", "nan_loss", "nan_grad_norm", "loss_spike", "grad_norm_spike"]  # index = the code in the table


class Outcome(str, Enum):
    KEEP = "keep"  # the state holds the step's (possibly re-run) result: snapshot it and go on
    SKIP = "skip"  # the state was rolled back to the step's start: move past its batch


class RankExcluded(RuntimeError):
    """Raised on the survivors when a rank was found persistently faulty: the generation must be rebuilt."""


@dataclass(frozen=True, kw_only=True)
class RerunHooks:
    exchange: Callable[[list[float]], list[list[float]]]
    rewind: Callable[[int], None]
    save: Callable[[int], "str | None"]
    exit: Callable[[int], NoReturn]
    publish: Callable[[str, bytes], None]  # store.set for the decision record


class RerunDriver:
    def __init__(self, config: RerunConfig, *, rank: int, world_size: int, emit: Callable[..., Any],
                 hooks: RerunHooks) -> None:
        assert config.enabled
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.emit = emit
        self.hooks = hooks
        self.machine = RerunMachine(config.validators())
        self.device_index: int | None = None  # this rank's CUDA device, when it has one

    # ------------------------------------------------------------ entry
    def precheck(self, result: StepResult) -> bool:
        """This rank's verdict, before its vote goes out: False means vote NaN (somebody rejected)."""
        return self.machine.validators.check(result).accepted

    def accept(self, result: StepResult) -> None:
        """An accepted result enters the running history (before the boundary it ends at is published)."""
        self.machine.count("steps_validated")
        self.machine.validators.commit(result)

    def resolve(self, step: int, first: StepResult, recompute: Callable[[int], StepResult]) -> Outcome:
        """The flow after somebody rejected ``step`` (every rank calls it, with the same ``step``).

        Nothing was committed: the state is still at the step's boundary.
        ``recompute(as_rank)`` computes the step as ``as_rank`` (its data, its
        RNG) up to its commit and returns the result.
        """
        try:
            return self._validate(step, first, recompute)
        except BaseException:
            self.machine.abort()
            raise

    def determinism(self, step: int, first: StepResult, recompute: Callable[[int], StepResult]) -> None:
        try:
            self._determinism(step, first, recompute)
        except BaseException:
            self.machine.abort()
            raise

    # ------------------------------------------------------- validation
    def _validate(self, step: int, first: StepResult, recompute: Callable[[int], StepResult]) -> Outcome:
        m = self.machine
        verdict = m.validators.check(first)
        table = self._share(verdict, first)
        rejected = [r for r, row in enumerate(table) if row[0] != 0]
        if not rejected:
            m.validators.commit(first)
            return Outcome.KEEP
        m.count("rejected", len(rejected))
        if not verdict.accepted:
            self.emit("rerun_rejected", rank=self.rank, step=step, verdict=verdict.as_dict(), result=first.as_dict())
        firsts = {r: _result(table[r]) for r in rejected}

        m.to(RerunState.RERUN_IN_PLACE)
        m.count("reruns")
        second = recompute(self.rank)
        verdict2 = m.validators.check(second)
        table2 = self._share(verdict2, second)
        seconds = {r: _result(row) for r, row in enumerate(table2)}
        transient = [r for r in rejected if table2[r][0] == 0 and not same_result(firsts[r], seconds[r])]
        reproduced = [r for r, row in enumerate(table2) if row[0] != 0 or (r in rejected and r not in transient)]
        for r in transient:
            self._decide(Classification.TRANSIENT, step, r, first=firsts[r], rerun=seconds[r])
        if not reproduced:
            m.to(RerunState.TRANSIENT)
            m.validators.commit(second)
            m.to(RerunState.HEALTHY)
            self._publish_record()
            return Outcome.KEEP

        persistent, genuine = [], []
        for s in reproduced:
            m.to(RerunState.RERUN_ON_PEER)
            peer = peer_for(s, reproduced, self.world_size)
            values: dict[str, Any] = {"first": firsts.get(s, seconds[s]).as_dict(), "rerun": seconds[s].as_dict()}
            if peer is None:  # every rank is under suspicion: nobody healthy to ask
                self._decide(Classification.GENUINE, step, s, peer_rank=None, note="no healthy peer", **values)
                genuine.append(s)
                continue
            m.count("peer_reruns")
            third = recompute(swap_assignment(self.world_size, s, peer)[self.rank])
            by_peer = _result(self._exchange_row(0, third)[peer])
            cls = Classification.GENUINE if same_result(by_peer, seconds[s]) else Classification.PERSISTENT
            if cls is Classification.PERSISTENT and self._excluded_before(s, step):
                # The replacement process computes the same: the fault is not bound to a process. Replacing
                # rank after rank would loop; whatever makes the peer differ, the value itself is the event.
                cls = Classification.GENUINE
                values["note"] = "reproduced by a replacement of the rank excluded here before"
            self._decide(cls, step, s, peer_rank=peer, peer=by_peer.as_dict(), **values)
            (genuine if cls is Classification.GENUINE else persistent).append(s)

        if persistent:
            m.to(RerunState.PERSISTENT)
            m.to(RerunState.HEALTHY)
            if self.rank in persistent:
                self.emit("rerun_excluded", rank=self.rank, step=step, exit_code=EXIT_RERUN_ELSEWHERE)
                self.hooks.exit(EXIT_RERUN_ELSEWHERE)
            if self.rank == min(r for r in range(self.world_size) if r not in persistent):
                self._publish_record()
            raise RankExcluded(f"rank(s) {persistent} computed wrong results at step {step}: excluded")
        m.to(RerunState.GENUINE)
        self.hooks.rewind(step)
        if self.config.on_genuine is OnGenuine.SKIP:
            m.count("skipped")
            m.to(RerunState.HEALTHY)
            self._publish_record()
            if self.rank == 0:
                self.emit("rerun_skipped", step=step, ranks=genuine)
            return Outcome.SKIP
        m.to(RerunState.STOPPED)
        path = self.hooks.save(step)
        if self.rank == 0:
            self.emit("rerun_stop", step=step, ranks=genuine, saved=path, exit_code=EXIT_VALIDATION_FAILED,
                      report=list(m.decisions)[-len(reproduced):])
        self.hooks.exit(EXIT_VALIDATION_FAILED)

    def _excluded_before(self, rank: int, step: int) -> bool:
        return any(d["classification"] == Classification.PERSISTENT.value and d["rank"] == rank and d["step"] == step
                   for d in self.machine.decisions)

    def _decide(self, cls: Classification, step: int, rank: int, **values: Any) -> None:
        record = {"rank": rank, "step": step,
                  **{k: v.as_dict() if isinstance(v, StepResult) else v for k, v in values.items()}}
        self.machine.classify(cls, record)
        if self.rank == 0:  # one event per decision; every rank took the same one
            self.emit("rerun_decision", classification=cls.value, **record)

    # ------------------------------------------------------ determinism
    def _determinism(self, step: int, first: StepResult, recompute: Callable[[int], StepResult]) -> None:
        m = self.machine
        m.to(RerunState.DETERMINISM_CHECK)
        second = recompute(self.rank)
        flag = 0.0 if same_result(first, second) else 1.0
        row = [flag, *_row_values(first), *_row_values(second)]
        table = self.hooks.exchange(row)
        mismatched = [r for r, t in enumerate(table) if t[0] != 0]
        m.count("determinism_checks")
        m.count("determinism_mismatches", len(mismatched))
        if self.rank == 0:
            self.emit("rerun_determinism", step=step, reproduced=not mismatched, mismatched_ranks=mismatched,
                      values={r: {"first": _result(table[r]).as_dict(), "rerun": _result(table[r][3:]).as_dict()}
                              for r in mismatched})
        m.to(RerunState.HEALTHY)

    # ----------------------------------------------------------- shared
    def _share(self, verdict: Verdict, result: StepResult) -> list[list[float]]:
        code = 0 if verdict.accepted else (_REASONS.index(verdict.reason) if verdict.reason in _REASONS
                                           else len(_REASONS))
        return self._exchange_row(code, result)

    def _exchange_row(self, code: int, result: StepResult) -> list[list[float]]:
        return self.hooks.exchange([float(code), *_row_values(result)])

    def _publish_record(self) -> None:
        self.hooks.publish(RECORD_KEY, json.dumps(self.machine.record_dict()).encode())

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return self.machine.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.machine.load_state_dict(sd)

    def adopt_record(self, record: dict[str, Any]) -> None:
        """The newest published record (a replacement's predecessor may have been excluded after its last snapshot)."""
        self.machine.load_record(record)

    def stateful(self) -> "RerunStateful":
        return RerunStateful(self)

    def summary(self) -> dict[str, Any]:
        return {"mode": self.config.mode.value, **self.machine.record_dict()}


def _row_values(r: StepResult) -> list[float]:
    return [r.loss, math.nan if r.grad_norm is None else r.grad_norm, 0.0 if r.grad_norm is None else 1.0]


def _result(row: list[float]) -> StepResult:
    """A StepResult from a table row ``[code, loss, grad_norm, has_grad_norm, ...]``."""
    return StepResult(loss=row[1], grad_norm=row[2] if row[3] else None)


class RerunStateful:
    """The machine as a :class:`~resilient_train.rank.train_state.Stateful` of the rank-local state: one JSON string."""

    def __init__(self, driver: RerunDriver) -> None:
        self._driver = driver

    def state_dict(self) -> dict[str, Any]:
        # The device whose CUDA RNG stream this rank uses: a peer computing as this rank takes that stream.
        return {"machine": json.dumps(self._driver.state_dict()), "device": self._driver.device_index}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._driver.load_state_dict(json.loads(sd["machine"]))
