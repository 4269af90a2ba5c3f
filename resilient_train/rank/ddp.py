"""DistributedDataParallel across generations, its buckets the fixed plan.

A DDP object is tied to the process group it was built on, and every
generation builds a new one. ``sup.ddp(model, **ddp_kwargs)`` returns a
:class:`ReplicatedModule`: call it as you would the DDP model; each
generation it builds DDP again on that generation's group, with the
supervisor's reducer as its communication hook.

Its buckets are the reducer's fixed plan (:class:`~resilient_train.rank.reducer.BucketPlan`),
made once, at construction: DDP's reducer holds the parameters in reverse
order (:class:`PlannedDDP`) and is rebuilt at once with every parameter in
that order, by the same rule the plan is cut with, so it never regroups its
buckets by the order gradients became ready (which DDP otherwise does after
its first iteration, in every generation again). The hook then reduces each
bucket's own buffer in place: no copy, the same bits in every generation, and
the same as ``ctx.average_gradients()``; communication still overlaps backward.
On NCCL (unless a part looks at the gradients) DDP reduces the plan's buckets
itself, with no hook (:meth:`GradientReducer.can_go_native`).

A script that builds DDP itself in ``on_new_group``, or inside the step in
each generation, works too: the supervisor finds that DDP (after
``on_new_group``, and at its first call after every restore) and registers
the same hook, which copies its buckets into the plan and back (its buckets
follow DDP's own grouping). A DDP built in an earlier generation and still in
use, or one with a communication hook of its own, is a misuse, stopped with
one line.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient_train.protocol import env as envvars
from resilient_train.base import exitcodes
from resilient_train.rank.errors import UsageError
from resilient_train.rank.phased import forward_in_phases
from resilient_train.rank.reducer import GradientReducer
from resilient_train.protocol.store import request_stop

__all__ = ["PlannedDDP", "ReplicatedModule", "adopt_ddp", "adopt_user_ddp", "explain_ddp_before_run", "find_ddp"]


class PlannedDDP(DDP):
    """DDP whose reducer holds the parameters in reverse order: the plan's order (see :func:`fix_buckets`).

    DDP lists the parameters in the order the module registers them and
    launches its buckets strictly in bucket order; with that list reversed,
    the buckets of a plan cut from it go out about as their gradients become
    ready in backward, so communication overlaps backward as DDP's own
    regrouping would, without depending on it.
    """

    def _build_params_for_reducer(self) -> tuple[list[torch.nn.Parameter], list[bool]]:
        params, sparse = super()._build_params_for_reducer()
        return params[::-1], sparse[::-1]


def fix_buckets(ddp: DDP) -> None:
    """Rebuilds ``ddp``'s buckets now, from its parameter list in order, once and for all.

    DDP rebuilds its buckets once, before the forward after its first
    backward, in the order the gradients arrived. Handing it every parameter
    in its own list's order first makes that one rebuild happen here, with
    the bucket rule the plan uses; DDP never rebuilds again. (It is a
    collective: every rank builds its DDP at the same point of the generation.)
    """
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()


class ReplicatedModule(torch.nn.Module):
    """``model`` data-parallel under the supervisor; rebuilt on every generation's process group."""

    def __init__(self, module: torch.nn.Module, ddp_kwargs: dict[str, Any],
                 phase: Callable[[str], None] = lambda name: None) -> None:
        super().__init__()
        for bad in ("process_group", "device_mesh"):
            if bad in ddp_kwargs:
                raise UsageError(f"sup.ddp(..., {bad}=...): the supervisor gives DDP each generation's group itself")
        odd = sorted({f"{name} ({p.dtype})" for name, p in module.named_parameters()
                      if p.requires_grad and not p.dtype.is_floating_point})
        if odd:
            raise UsageError(f"sup.ddp(model): the fixed bucket plan reduces real floating-point gradients; "
                             f"{', '.join(odd[:3])} {'is' if len(odd) == 1 else 'are'} not (mixed float dtypes are fine)")
        self.module = module
        self._kwargs = ddp_kwargs
        self._ddp: DDP | None = None
        self._phase = phase  # marks forward and backward for the monitors and chaos faults

    def rebuild(self, group: dist.ProcessGroup, reducer: GradientReducer, *, first: bool) -> None:
        """Builds DDP on ``group``; only the first generation syncs the module from rank 0 (later ones heal)."""
        self.drop()  # the last generation's DDP goes first: it holds the old group
        kwargs = dict(self._kwargs)
        # NCCL: DDP reduces the plan's buckets itself, as a plain DDP loop would. Its gradients are then not
        # views of its buckets: with views, DDP divides a gradient in place in some steps and while copying
        # it in others (after a recovery dropped the gradients), which are not the same bits.
        native = reducer.can_go_native(group) and not kwargs.get("gradient_as_bucket_view", False)
        # Through the hook: the gradients are views of DDP's buckets, which DDP then does not copy back.
        kwargs.setdefault("gradient_as_bucket_view", not native)
        kwargs["bucket_cap_mb"] = reducer.plan.bucket_mb  # the plan's cut (first bucket included)
        if not first:
            kwargs.setdefault("init_sync", False)
        ddp = PlannedDDP(self.module, process_group=group, **kwargs)
        fix_buckets(ddp)
        reducer.register(ddp, planned=True, native=native)
        object.__setattr__(self, "_ddp", ddp)  # not a submodule: state_dict() stays the model's

    def bucket_mb(self, default: float) -> float:
        """The plan's bucket size for this model: DDP's ``bucket_cap_mb`` if the script gave one."""
        given = self._kwargs.get("bucket_cap_mb")
        return float(given) if given is not None else default

    def drop(self) -> None:
        """Forgets this generation's DDP (and with it, its process group)."""
        object.__setattr__(self, "_ddp", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._ddp is None:
            raise UsageError("the DDP model was called outside sup.run: it exists once a generation's group is built")
        return forward_in_phases(self._ddp, self._phase, *args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync`` (gradient accumulation) on the current generation's DDP."""
        if self._ddp is None:
            raise UsageError("no_sync() outside sup.run")
        with self._ddp.no_sync():
            yield


def find_ddp(module: torch.nn.Module) -> list[DDP]:
    """The DDP objects that wrap ``module`` (found through who refers to it; once per generation)."""
    gc.collect()  # a DDP of an earlier generation that nothing refers to any more is not in use
    found: list[DDP] = []
    # module <- DDP._modules (a dict) <- the DDP, or its __dict__ <- the DDP: two levels of dicts at most.
    frontier: list[Any] = [module]
    for _ in range(3):
        nxt = []
        for obj in frontier:
            for ref in gc.get_referrers(obj):
                if isinstance(ref, DDP) and ref.module is module and not any(ref is f for f in found):
                    found.append(ref)
                elif isinstance(ref, dict) and ref is not frontier:
                    nxt.append(ref)
        frontier = nxt
    return found


def adopt_user_ddp(module: torch.nn.Module, group: dist.ProcessGroup, make_reducer: Callable[[], GradientReducer],
                   generation: int) -> int:
    """Gives the DDPs a script built itself around ``module`` on ``group`` the plan's hook (the copy path).

    Returns how many were adopted. A DDP of an earlier generation is left
    alone here: a script that builds its DDP again inside the step still holds
    the old one now. Calling it is refused (:class:`resilient_train.rank.misuse.MisuseChecks`
    looks at every DDP call from a restore on).
    """
    current = [ddp for ddp in find_ddp(module) if ddp.process_group is group]
    return sum(adopt_ddp(ddp, group, lambda _: make_reducer(), generation) for ddp in current)


def adopt_ddp(ddp: DDP, group: dist.ProcessGroup | None, make_reducer: Callable[[torch.nn.Module], GradientReducer],
              generation: int) -> bool:
    """Gives a DDP the script built itself the plan's hook (``make_reducer(ddp.module)``); True if it was adopted now.

    ``sup.ddp``'s own DDP and one adopted already are left as they are. A DDP
    of an earlier generation, or one with a communication hook of its own
    (the plan's hook carries the commit vote), is refused (:class:`UsageError`).
    """
    if isinstance(ddp, PlannedDDP):
        return False  # sup.ddp's: it has its reducer (or reduces the plan's buckets itself)
    if ddp.process_group is not group:
        raise UsageError(
            f"a DistributedDataParallel built in an earlier generation is still in use in generation {generation}: "
            "build it in on_new_group (or use sup.ddp(model)); each generation has a new process group")
    hooks = getattr(ddp, "_comm_hooks", [])
    if any(isinstance(state, GradientReducer) for _, state in hooks):
        return False
    if hooks:
        raise UsageError("a DistributedDataParallel with a communication hook of its own: the supervisor's hook "
                         "reduces the fixed bucket plan and carries the commit vote; drop register_comm_hook "
                         "(or use sup.ddp(model))")
    make_reducer(ddp.module).register(ddp)
    return True


def explain_ddp_before_run(store: dist.Store, rank: int) -> None:
    """A DDP built before ``sup.run`` fails deep in torch; say in one line (once per job) what to do instead."""
    previous = sys.excepthook

    def hook(kind: type, exc: BaseException, tb: Any) -> None:
        if isinstance(exc, (ValueError, RuntimeError)) and "process group has not been initialized" in str(exc):
            torch_dir = os.path.dirname(torch.__file__)
            frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(torch_dir)]
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            reason = (f"a process group was used before sup.run built one{where}: wrap the model with "
                      "sup.ddp(model), or build DDP in on_new_group")
            try:
                first = request_stop(store, {"rank": rank, "summary": reason, "exit_code": exitcodes.STOPPED})
            except Exception:  # noqa: BLE001  (no store: say it anyway)
                first = {"rank": rank}
            if first.get("rank") == rank and os.environ.get(envvars.RT_AGENT) != "1":  # else the agent says it
                print(f"resilient-train: error: {reason}", file=sys.stderr, flush=True)
            os._exit(exitcodes.STOPPED)
        previous(kind, exc, tb)

    sys.excepthook = hook
