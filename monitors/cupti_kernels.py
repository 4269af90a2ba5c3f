"""Optional backend: NVRx's CUPTI kernel straggler detector, inside a GPU rank.

Our own straggler scores time each section with CUDA events
(``monitors.device_timing``) and are computed by the node agent. NVRx's
``straggler.Detector`` (nvidia-resiliency-ext 0.4.1, the ``nvrx`` extra) goes
one level down: CUPTI records every kernel's device time, and its scores
compare ranks kernel by kernel (NCCL kernels excluded), so a slow GPU shows
even when the sections around it are dominated by waiting.

``CuptiKernelScores`` opens an NVRx detection section at every phase change
before the step's collective (data, forward, backward) and, every
``report_every_steps`` steps, makes every rank call ``generate_report()``.
That call is collective on the default process group, which the supervisor
rebuilds for each generation. It is driven by the step number, identical on
every rank, and not by NVRx's own ``generate_report_if_interval_elapsed``,
whose per-process call counter would disagree once a replacement rank joins.
NVRx's reporter also keeps per-process state that its collectives rely on
(node names gathered at the first report, kernel name ids), so every rank
starts a fresh detector at every new generation (``on_new_generation``): a
replacement and the survivors then agree again, and what a failed generation
measured is dropped. Rank 0 receives the gathered report and returns it as
plain data; the caller writes it to the event log.

Without the extra or without CUDA, :func:`unavailable_reason` says why and
nothing here is imported.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any


# Sections that end before the step's gradient all-reduce is queued. Closing an NVRx section disables
# CUPTI's kernel activity, which waits for the kernels in flight: with an all-reduce queued behind a dead
# peer it never returns (seen on 2 x H200: a survivor stuck there until the agent killed it as hung).
PRE_COLLECTIVE_SECTIONS: tuple[str, ...] = ("data", "forward", "backward")

__all__ = ["CuptiConfig", "CuptiKernelScores", "nvrx_installed", "unavailable_reason"]


@dataclass(kw_only=True)
class CuptiConfig:
    report_every_steps: int = 100  # every rank reports its kernel scores every N steps
    threshold: float = 0.75  # a GPU's kernel score below this names it a straggler in the report
    sections: tuple[str, ...] = PRE_COLLECTIVE_SECTIONS  # profiled (a subset of data, forward, backward)

    def __post_init__(self) -> None:
        if not self.sections or set(self.sections) - set(PRE_COLLECTIVE_SECTIONS):
            raise ValueError(
                f"CuptiConfig.sections must be a non-empty subset of {PRE_COLLECTIVE_SECTIONS}: closing a CUPTI "
                f"section waits for the kernels in flight, which must never include a collective"
            )
        if self.report_every_steps < 1:
            raise ValueError(f"CuptiConfig.report_every_steps must be >= 1, got {self.report_every_steps}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"CuptiConfig.threshold must be in (0, 1], got {self.threshold}")


def nvrx_installed() -> bool:
    """Whether NVRx's straggler package can be imported (an empty leftover directory does not count)."""
    try:
        return importlib.util.find_spec("nvidia_resiliency_ext.straggler") is not None
    except ModuleNotFoundError:  # no parent package at all
        return False


def unavailable_reason() -> str | None:
    """Why the CUPTI backend cannot run here, or ``None`` when it can."""
    if not nvrx_installed():
        return "nvidia-resiliency-ext is not installed (pip install 'resilient-train[nvrx]')"
    import torch

    if not torch.cuda.is_available():
        return "CUPTI kernel profiling needs a CUDA device"
    return None


class CuptiKernelScores:
    """One per rank; driven by the supervisor's phase changes and step boundaries."""

    def __init__(self, config: CuptiConfig) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the CUPTI straggler backend is unavailable: {reason}")
        from nvidia_resiliency_ext import straggler

        self.config = config
        self._detector = straggler.Detector
        self._open: Any = None

    def on_new_generation(self) -> None:
        """Every rank, after each new process group: a fresh NVRx detector (see the module docstring)."""
        self._close_section()
        if self._detector.initialized:
            self._detector.shutdown()
        self._detector.initialize(scores_to_compute="all", gather_on_rank0=True, profiling_interval=1,
                                  report_time_interval=1e9)  # we decide when to report

    def enter(self, section: str) -> None:
        """The rank's main thread moved to ``section``: profile it if it is the rank's own work."""
        self._close_section()
        if section in self.config.sections and self._detector.initialized:
            self._open = self._detector.detection_section(section, profile_cuda=True)
            self._open.__enter__()

    def due(self, step: int) -> bool:
        return step > 0 and step % self.config.report_every_steps == 0

    def report(self, step: int) -> dict[str, Any] | None:
        """Collective: every rank calls it at the same step. Rank 0 gets the scores, the others ``None``."""
        self._close_section()
        rep = self._detector.generate_report()
        if rep is None:
            return None
        t = self.config.threshold
        found = rep.identify_stragglers(gpu_rel_threshold=t, section_rel_threshold=t,
                                        gpu_indiv_threshold=t, section_indiv_threshold=t)
        return {
            "step": step,
            "threshold": t,
            "gpu_relative": _by_rank(rep.gpu_relative_perf_scores),
            "gpu_individual": _by_rank(rep.gpu_individual_perf_scores),
            "section_relative": {s: _by_rank(v) for s, v in rep.section_relative_perf_scores.items()},
            "stragglers_relative": sorted(s.rank for s in found["straggler_gpus_relative"]),
            "stragglers_individual": sorted(s.rank for s in found["straggler_gpus_individual"]),
            "report_ms": round(float(rep.generate_report_elapsed_time), 3),
        }

    def close(self) -> None:
        self._close_section()
        if self._detector.initialized:
            self._detector.shutdown()

    def _close_section(self) -> None:
        if self._open is not None:
            cm, self._open = self._open, None
            cm.__exit__(None, None, None)


def _by_rank(scores: dict[int, float]) -> dict[str, float | None]:
    return {str(r): (None if v != v else round(float(v), 4)) for r, v in sorted(scores.items())}  # NaN: no data
