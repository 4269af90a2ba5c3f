"""The supervisor's side of the rerun state machine: measuring, re-running, rewinding.

:class:`RerunSupport` is mixed into :class:`resilient_train.Supervisor`; it is
the host that :class:`resilient_train.rerun.RerunDriver` drives. It measures
each computation (the loss the step reports through ``ctx.loss`` and the
local gradient norm before the all-reduce), recomputes a step from its
snapshot as any rank (that rank's published local state: RNG and data
position; ``ctx.data_rank`` names whose batch it is), shares values over the
process group, and saves the last good state when the policy stops the job.
It uses the supervisor's attributes: ``state``, ``ctx``, ``env``, ``store``,
``device``, ``run_dir``, ``events``, ``generation``, ``config``, ``_ring``,
``_averager``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from resilient_train.rerun.driver import RECORD_KEY, RerunDriver, RerunHooks
from resilient_train.rerun.validators import StepResult
from resilient_train.store import Keys, wait_until
from resilient_train.train_state import as_float, decode_local

__all__ = ["RerunSupport"]

StepFn = Callable[[Any], Any]


class RerunSupport:
    """Mixin: requires the supervisor's attributes listed in the module docstring."""

    _rerun: RerunDriver | None
    _measured: list[torch.Tensor | None]
    _agreed_ok: bool | None = None  # set by the gradient all-reduce: nobody rejected (True), somebody did (False)

    def _make_rerun(self) -> RerunDriver:
        hooks = RerunHooks(exchange=self._exchange, rewind=self._rewind, save=self._save_for_stop, exit=_exit,
                           publish=lambda key, value: self.store.set(key, value))
        driver = RerunDriver(self.config.rerun, rank=self.env.rank, world_size=self.env.world_size,
                             emit=self.events.emit, hooks=hooks)
        driver.device_index = self.device.index if self.device.type == "cuda" else None
        return driver

    def _compute(self, step_fn: StepFn, step: int, as_rank: int) -> Any:
        """One computation of ``step`` with ``as_rank``'s data (the caller loaded that rank's local state)."""
        self.ctx.step, self.ctx.data_rank = step, as_rank
        self._measured = [None, None]
        self._agreed_ok = None
        return step_fn(self.ctx)

    def _after_step(self, step_fn: StepFn, out: Any) -> None:
        step = self.state.step
        assert self._rerun is not None

        def recompute(as_rank: int) -> StepResult:
            self._rewind(step, as_rank)
            return self._result(self._compute(step_fn, step, as_rank))

        self._rerun.after_step(step, self._result(out), recompute, agreed_ok=self._agreed_ok)
        self.ctx.data_rank = self.env.rank

    def _result(self, out: Any) -> StepResult:
        loss = as_float(self._measured[0] if self._measured[0] is not None else out)
        if loss is None:
            raise ValueError("rerun validation needs the step's loss: return it from the step or pass it to ctx.loss()")
        norm = self._measured[1]
        return StepResult(loss=loss, grad_norm=None if norm is None else float(norm))

    def _rewind(self, step: int, as_rank: int | None = None) -> None:
        """Back to the snapshot of ``step``; with ``as_rank``, with that rank's local state (RNG, data position)."""
        snap = self._ring.get(step)
        self.state.load_replicated(snap.replicated())
        local = snap.local
        if as_rank is not None and as_rank != self.env.rank:
            head, local = self.store.get(Keys.local_state(as_rank, step % 2)).split(b"\n", 1)
            assert int(head) == step, (int(head), step)
        sd = decode_local(local)
        theirs = sd.pop("rerun", {}).get("device")  # the machine is mid-flow: its own state stays
        cuda = sd.get("rng", {}).get("cuda")
        if cuda is not None and theirs is not None and self.device.type == "cuda" and theirs != self.device.index:
            # Their dropout stream lives on their device: it becomes this device's stream.
            cuda = list(cuda)
            cuda[self.device.index] = cuda[theirs]
            sd["rng"]["cuda"] = cuda
        self.state.load_local(sd)

    def _exchange(self, row: list[float]) -> list[list[float]]:
        """Every rank's ``row``, to every rank: one all-reduce of a table with a row per rank."""
        table = torch.zeros(self.env.world_size, len(row), dtype=torch.float64, device=self.device)
        table[self.env.rank] = torch.tensor(row, dtype=torch.float64)
        if self.env.world_size > 1:
            dist.all_reduce(table)
        return table.cpu().tolist()

    def _on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self._values:
            loss = self._values.corrupt_loss(loss, step=self.ctx.step, data_rank=self.ctx.data_rank)
        self._measured[0] = loss.detach()
        return loss

    def _reduce_gradients(self) -> None:
        """The gradient all-reduce, with value faults before it and, in validate mode, the verdict riding on it.

        A rank that rejects its step poisons one gradient element with NaN
        before the all-reduce; every rank then reads that element of the
        averaged gradient and knows whether anybody rejected, so a healthy step
        needs no collective of its own. (A rejected step is thrown away, so the
        poison costs nothing; healthy steps are computed exactly as without
        validation.)
        """
        self._agreed_ok = None
        if not self._values and self._rerun is None:
            self._averager()
            return
        grads = [p.grad for p in self._averager.params if p.grad is not None]
        if self._values:
            self._values.corrupt_grads(grads, step=self.ctx.step)
        signal = self._rerun is not None and self._rerun.piggyback and self._measured[0] is not None
        if self._rerun is not None and grads:
            self._measured[1] = torch.nn.utils.get_total_norm(grads)  # local: before the all-reduce mixes ranks
        first = self._averager.params[0]
        if signal and not self._rerun.precheck(self._result(None)):  # type: ignore[union-attr]
            if first.grad is None:
                first.grad = torch.zeros_like(first)
            first.grad.view(-1)[0] = float("nan")
        self._averager()
        if signal:
            self._agreed_ok = bool(torch.isfinite(first.grad.view(-1)[0]))  # type: ignore[union-attr]

    def _load_rerun(self, local: dict[str, Any], *, replacement: bool) -> None:
        """A replacement adopts the newest decision record (``local`` itself was loaded by ``load_local``)."""
        if self._rerun is None or not replacement or not self.store.check([RECORD_KEY]):
            return
        self._rerun.adopt_record(json.loads(self.store.get(RECORD_KEY)))

    def _save_for_stop(self, step: int) -> str | None:
        """Rank 0 writes the state of ``step`` (the last good one) to the run dir; the others wait for it."""
        key = f"rt/gen/{self.generation}/rerun/saved"
        if self.env.rank == 0:
            path = ""
            if self.run_dir is not None:
                from checkpointing import write_state

                locals_ = {}
                for r in range(self.env.world_size):
                    head, payload = self.store.get(Keys.local_state(r, step % 2)).split(b"\n", 1)
                    assert int(head) == step, f"rank {r} published step {int(head)}, expected {step}"
                    locals_[r] = decode_local(payload)
                path = str(self.run_dir / f"rerun-stop-step-{step}")
                write_state(path, self.state.state_dict(local_states=locals_), step=step,
                            extras={"world_size": self.env.world_size})
            self.store.set(key, path)
            return path or None
        wait_until(lambda: self.store.check([key]), timeout=self.config.rerun.stop_timeout_s, what="the saved state")
        return self.store.get(key).decode() or None


def _exit(code: int) -> NoReturn:
    raise SystemExit(code)

