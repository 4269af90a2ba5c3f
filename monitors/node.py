"""``NodeMonitor``: the one object a node agent polls from its monitor loop.

It composes hang detection, straggler scoring and the metrics sinks, writes
every finding to the run's event log, and returns what the agent must act on.
It never kills or respawns anything itself.

Events written: ``hang_detected`` (rank, pid, section, step, since_progress_s,
timeout_s, waiting_on), ``straggler_report`` (interval, enabled, threshold,
scores: per rank, its scores, medians, the clock that timed it and its
sections), ``straggler_detected`` (rank, action, relative, individual,
intervals_below), ``progress_read_inconsistent`` (a slot read that could not be
judged; total so far).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from resilient_train.base.configfile import kind, load_config_file, require_bool, require_int, require_str
from resilient_train.base.configtree import build
from monitors.events import EventLog
from monitors.hang import HangDetector
from monitors.hangconfig import HangConfig
from monitors.hangverdict import Hang, ranks_to_kill
from monitors.jobwide import JobWideBest
from monitors.metrics import MetricsSink, PrometheusSink, Sample, TensorBoardSink
from monitors.persist import read_json_file, write_json_atomic
from monitors.straggler import StragglerConfig, StragglerDetector, StragglerReport

__all__ = ["MAX_RANKS_PER_CORE", "MetricsConfig", "MonitorConfig", "MonitorResult", "NodeMonitor", "max_local_ranks"]

# Ranks one node may run per CPU core. The test suite runs 4 ranks on 2 cores; much past that a healthy
# rank waits for a core longer than the hang detector's floor (HangConfig.min_timeout_s, 3 s) and is killed
# as hung, and every rank is an interpreter with torch imported (about 0.2 GiB, twice with its
# checkpoint writer process).
MAX_RANKS_PER_CORE = 4


def max_local_ranks(cpus: int | None = None) -> int:
    """The most ranks one node is given: 4 per CPU core, and at least 8 (a GPU node's usual count)."""
    cpus = cpus if cpus is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                         else os.cpu_count() or 1)
    return max(8, MAX_RANKS_PER_CORE * cpus)


@dataclass(kw_only=True)
class MetricsConfig:
    prometheus: bool = True  # serve the scores and section times as Prometheus metrics
    prometheus_host: str = "127.0.0.1"  # the address the endpoint binds
    prometheus_port: int = 0  # 0 picks a free port; see NodeMonitor.prometheus_url
    tensorboard: bool = True  # used only when tensorboard is importable
    tensorboard_dir: str | None = None  # default RUN_DIR/tensorboard

    def __post_init__(self) -> None:
        require_bool(self.prometheus, "metrics.prometheus")
        require_bool(self.tensorboard, "metrics.tensorboard")
        if not require_str(self.prometheus_host, "metrics.prometheus_host", max_len=255):
            raise ValueError("metrics.prometheus_host must not be empty")
        require_int(self.prometheus_port, "metrics.prometheus_port", low=0, high=65535)
        require_str(self.tensorboard_dir, "metrics.tensorboard_dir", allow_none=True)


@dataclass(kw_only=True)
class MonitorConfig:
    hang: HangConfig = field(default_factory=HangConfig)  # hung ranks: killed and recovered
    straggler: StragglerConfig = field(default_factory=StragglerConfig)  # slow ranks: logged or replaced
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # where the findings go besides events.jsonl

    @classmethod
    def from_dict(cls, data: Any) -> "MonitorConfig":
        """From plain data (a YAML or JSON file): ``{"hang": {...}, "straggler": {...}, "metrics": {...}}``."""
        parts = {"hang": HangConfig, "straggler": StragglerConfig, "metrics": MetricsConfig}
        if not isinstance(data, dict):
            raise ValueError(f"a monitor config must be a mapping of {sorted(parts)}, got {kind(data)}")
        unknown = sorted(str(k) for k in data if k not in parts)
        if unknown:
            raise ValueError(f"unknown section(s) {unknown}; expected some of {sorted(parts)}")
        kwargs = {name: build(parts[name], sub, name) for name, sub in data.items() if sub is not None}
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "MonitorConfig":
        """From a YAML (or JSON, a subset of YAML) file; every mistake is a one-line ``ValueError`` naming it."""
        data = load_config_file(path, "monitor config")
        try:
            return cls.from_dict({} if data is None else data)
        except ValueError as e:
            raise ValueError(f"monitor config {str(path)!r}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class MonitorResult:
    hangs: list[Hang]  # hung ranks, oldest progress first
    kill: list[int]  # hung ranks to kill now (not merely waiting in a collective on a local peer)
    report: StragglerReport | None  # set when a report interval elapsed
    replace: list[int]  # ranks newly flagged under the "replace" policy


class NodeMonitor:
    """Polled every ~50 ms by the agent; ``poll`` reads files and never blocks."""

    def __init__(
        self,
        config: MonitorConfig,
        run_dir: str | os.PathLike[str],
        ranks: Iterable[int],
        *,
        events: EventLog | None = None,
        sinks: list[MetricsSink] | None = None,
        peers: JobWideBest | None = None,
    ) -> None:
        ranks = list(ranks)
        self.config = config
        self.run_dir = Path(run_dir)
        self.events = events if events is not None else EventLog(self.run_dir / "events.jsonl", source="monitor")
        self.hangs = HangDetector(config.hang, run_dir, ranks)
        self.stragglers = StragglerDetector(config.straggler, run_dir, ranks, peers=peers)
        self.sinks: list[MetricsSink] = list(sinks or [])
        self._prometheus: PrometheusSink | None = None
        m = config.metrics
        if sinks is None:
            if m.prometheus:
                try:
                    self._prometheus = PrometheusSink(host=m.prometheus_host, port=m.prometheus_port)
                except OSError as e:  # a host not on this machine, a port in use: the user's input
                    raise ValueError(f"metrics: cannot serve Prometheus on {m.prometheus_host}:{m.prometheus_port}: "
                                     f"{e.strerror or e}") from None
                self.sinks.append(self._prometheus)
            if m.tensorboard:
                tb = TensorBoardSink.create(m.tensorboard_dir or str(self.run_dir / "tensorboard"))
                if tb is not None:
                    self.sinks.append(tb)
        self._reported: set[tuple[int, int, int]] = set()
        self._hangs_total: dict[int, int] = {r: 0 for r in ranks}
        self._state_on_disk: dict[str, Any] | None = None  # what save_state last wrote or load_state read
        self.events.emit("monitor_start", ranks=ranks, prometheus=self.prometheus_url,
                         tensorboard=any(isinstance(s, TensorBoardSink) for s in self.sinks),
                         hang=asdict(config.hang), straggler=asdict(config.straggler))

    @property
    def prometheus_url(self) -> str | None:
        return self._prometheus.url if self._prometheus else None

    def reset(self, rank: int, now: float | None = None, *, expect_progress: bool = False) -> None:
        """``rank`` was respawned (after a crash, a hang or a replacement); see ``HangDetector.reset``."""
        self.hangs.reset(rank, now, expect_progress=expect_progress)
        self.stragglers.reset(rank)

    def poll(self, now: float | None = None) -> MonitorResult:
        now = time.monotonic() if now is None else now
        skipped = self.hangs.inconsistent_reads
        hangs = self.hangs.poll(now)
        if self.hangs.inconsistent_reads > skipped:
            self.events.emit("progress_read_inconsistent", total=self.hangs.inconsistent_reads)
        kill = ranks_to_kill(hangs, self.config.hang.collective_sections)
        for h in hangs:
            key = (h.rank, h.pid or 0, h.step)
            if key not in self._reported:
                self._reported.add(key)
                self._hangs_total[h.rank] = self._hangs_total.get(h.rank, 0) + 1
                self.events.emit("hang_detected", **asdict(h), waiting=h.blocked_by_peer)
        report = self.stragglers.poll(now)
        replace: list[int] = []
        if report is not None:
            self.events.emit(
                "straggler_report", interval=report.interval, enabled=report.enabled,
                threshold=report.threshold, control_read_at=report.control_read_at,
                job_best_s=None if report.job_best_s is None else round(report.job_best_s, 6),
                job_nodes=report.job_nodes,
                scores={str(r): {"relative": round(s.relative, 4), "individual": round(s.individual, 4),
                                 "step_s": round(s.step_s, 6), "work_s": round(s.work_s, 6),
                                 "steps": s.steps, "last_step": s.last_step, "clock": s.clock,
                                 "sections_s": {k: round(v, 6) for k, v in s.sections_s.items() if v > 0}}
                        for r, s in report.scores.items()},
            )
            for d in report.flagged:
                if d.new:
                    self.events.emit("straggler_detected", interval=report.interval, **asdict(d))
                    if d.action == "replace":
                        replace.append(d.rank)
            self._publish(report, now)
        return MonitorResult(hangs=hangs, kill=kill, report=report, replace=replace)

    def samples(self, report: StragglerReport | None, now: float) -> list[Sample]:
        out = [
            Sample(name="resilient_train_straggler_enabled", value=float(report.enabled) if report else 1.0,
                   help="1 when straggler detection is on"),
        ]
        if report is not None:
            out.append(Sample(name="resilient_train_straggler_threshold", value=report.threshold,
                              help="score below which a rank counts as slow"))
        flagged = {d.rank for d in report.flagged} if report else set()
        for rank, snap in sorted(self.hangs.last.items()):
            lab = {"rank": str(rank)}
            out.append(Sample(name="resilient_train_hangs_total", value=self._hangs_total.get(rank, 0),
                              labels=lab, kind="counter", help="hangs detected"))
            if snap is not None:
                out.append(Sample(name="resilient_train_step", value=snap.step, labels=lab,
                                  help="the step the rank works on"))
                out.append(Sample(name="resilient_train_seconds_since_progress",
                                  value=max(0.0, now - snap.last_progress_s), labels=lab,
                                  help="time since the rank's main thread last changed section"))
        if report is not None:
            for rank, s in sorted(report.scores.items()):
                lab = {"rank": str(rank)}
                out += [
                    Sample(name="resilient_train_step_seconds", value=s.step_s, labels=lab,
                           help="median step time over the last report interval"),
                    Sample(name="resilient_train_work_seconds", value=s.work_s, labels=lab,
                           help="median time in the scored (own-work) sections per step"),
                    Sample(name="resilient_train_straggler_relative_score", value=s.relative, labels=lab,
                           help="best rank's median work time / this rank's"),
                    Sample(name="resilient_train_straggler_individual_score", value=s.individual, labels=lab,
                           help="this rank's best interval median / its current one"),
                    Sample(name="resilient_train_straggler_flagged", value=float(rank in flagged), labels=lab,
                           help="1 while the rank is flagged as a straggler"),
                ]
                out += [Sample(name="resilient_train_section_seconds", value=v,
                               labels={"rank": str(rank), "section": sec, "clock": s.clock},
                               help="median time per step in a section, on the device (cuda) or wall clock")
                        for sec, v in s.sections_s.items() if v > 0]
        return out

    def _publish(self, report: StragglerReport, now: float) -> None:
        samples = self.samples(report, now)
        step = max((s.last_step for s in report.scores.values()), default=report.interval)
        for sink in self.sinks:
            sink.write(samples, step)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state to save in a checkpoint (the computed hang timeouts)."""
        return {"hang": self.hangs.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "hang" in state:
            self.hangs.load_state_dict(state["hang"])

    def save_state(self, path: str | os.PathLike[str]) -> bool:
        """Writes ``state_dict()`` as JSON to ``path`` atomically (a temporary file, then a rename).
        Returns False when the state is the one this monitor last saved or loaded (nothing written)."""
        state = self.state_dict()
        if state == self._state_on_disk:
            return False
        write_json_atomic(Path(path), state)
        self._state_on_disk = state
        return True

    def timeouts_changed(self) -> bool:
        """True when the timeouts applied now differ from the saved ones (save them soon: checkpoints carry them)."""
        saved = (self._state_on_disk or {}).get("hang", {}).get("timeouts_s")
        return saved != self.hangs.state_dict()["timeouts_s"]

    def load_state(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """Merges the state ``save_state`` wrote (a job restarted in the same run directory keeps its
        computed timeouts). Returns the state loaded, None when there is no file. A file that does not
        parse raises ValueError."""
        try:
            state = read_json_file(Path(path))
        except FileNotFoundError:
            return None
        except ValueError as e:
            raise ValueError(f"monitor state {e}") from None
        try:
            if not isinstance(state, dict):
                raise ValueError("not a JSON object")
            self.load_state_dict(state)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"monitor state {str(path)!r}: {e}") from None
        self._state_on_disk = self.state_dict()
        return state

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.hangs.close()
        self.stragglers.close()
