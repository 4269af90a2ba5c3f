"""The kill policy for hung ranks and stragglers, and the stacks of a hung rank before it dies.

The node's hang and straggler monitor (monitors.NodeMonitor) watches the
progress the ranks report; this policy turns what it finds into events: a
rank to kill (hung, or a straggler under the "replace" policy) and a hung
rank whose stack dump has had its time. Killing is :meth:`HangPolicy.kill`:
a hung rank that can answer SIGUSR2 writes its stacks first (monitors.stacks,
at most ``DUMP_WAIT_S``), then it is SIGKILLed, which ends a stopped process
too. A killed rank then recovers like a dead one; its cause goes with it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from monitors import EventLog, MonitorConfig, NodeMonitor
from monitors.jobwide import JobWideBest
from monitors.stacks import DUMP_WAIT_S, StackDumps
from resilient_train.agent.events import RankHung, StacksDue
from resilient_train.agent.workers import Worker, kill_reason

__all__ = ["HangPolicy"]


class HangPolicy:
    """This node's monitor (:attr:`monitor`) and what the agent does about its findings."""

    def __init__(self, config: MonitorConfig, run_dir: Path, *, events: EventLog, say: Callable[[str], None]) -> None:
        self.config, self.run_dir, self.events, self._say = config, run_dir, events, say
        self.stacks = StackDumps(run_dir)
        self.monitor: NodeMonitor | None = None
        self.reported_step = -1  # the highest step any rank of this attempt reported

    def watch(self, ranks: range | tuple[int, ...], *, store: dist.Store | None, node: int, nnodes: int,
              node_timeout_s: float) -> NodeMonitor:
        """The monitor of ``ranks`` (none for a spare still waiting for a node); many nodes (``store``): straggler
        scores against the whole job's fastest rank, shared through the store."""
        c = self.config
        peers = (JobWideBest(store, node=node, nnodes=nnodes,
                             stale_after_s=3 * c.straggler.report_interval_s + node_timeout_s)
                 if store is not None else None)
        if self.monitor is not None:
            self.monitor.close()
        self.monitor = NodeMonitor(c, self.run_dir, ranks, events=EventLog(self.run_dir / "events.jsonl",
                                                                            source="monitor", say=self._say),
                                   peers=peers)
        return self.monitor

    def expect(self, rank: int, *, had_worker: bool) -> None:
        """Before ``rank``'s worker starts: a warm spare creates its progress slot at once, and a slot that
        exists when the detector is reset is taken for the dead worker's and never watched. A rank whose
        predecessor reported progress is watched from its spawn (a replacement stuck starting)."""
        assert self.monitor is not None
        reported = had_worker and self.monitor.hangs.last.get(rank) is not None
        self.monitor.reset(rank, expect_progress=reported)

    def step_of(self, rank: int) -> int:
        """The step ``rank``'s progress slot shows now (-1: none yet)."""
        snap = self.monitor.hangs.read(rank) if self.monitor is not None else None
        return snap.step if snap is not None else -1

    def new_attempt(self) -> None:
        self.reported_step = -1

    # ------------------------------------------------------------ polling
    def poll(self, workers: list[Worker]) -> list[RankHung | StacksDue]:
        """Ranks to kill now, and hung ranks whose stacks are in (or whose time to write them is up)."""
        assert self.monitor is not None
        found = self.monitor.poll()
        for snap in self.monitor.hangs.last.values():
            if snap is not None and snap.step > self.reported_step:
                self.reported_step = snap.step
        causes: dict[int, dict] = {r: {"kind": "straggler"} for r in found.replace}
        for h in found.hangs:
            if h.rank in found.kill:
                causes[h.rank] = {"kind": "hang", "phase": h.section, "step": h.step, "evidence": h.evidence,
                                  "for_s": round(h.for_s, 3), "since_progress_s": round(h.since_progress_s, 3),
                                  "timeout_s": h.timeout_s, "reason": h.describe()}
        by_rank = {w.rank: w for w in workers}
        events: list[RankHung | StacksDue] = []
        for rank, cause in causes.items():
            w = by_rank.get(rank)
            if w is not None and w.cause is None and w.proc.poll() is None:
                events.append(RankHung(rank=rank, pid=w.proc.pid, cause=cause))
        now = time.monotonic()
        for w in workers:
            if w.kill_at is not None and (now >= w.kill_at or self.stacks.written(w.rank)):
                events.append(StacksDue(rank=w.rank, pid=w.proc.pid))
        return events

    # ------------------------------------------------------------ acting
    def kill(self, w: Worker, cause: dict, *, dump_stacks: bool) -> None:
        w.cause = cause
        self._say(f"killing rank {w.rank}: {kill_reason(cause)}")
        if dump_stacks and self.stacks.request(w.rank, w.proc.pid):
            w.kill_at = time.monotonic() + DUMP_WAIT_S  # its stacks first, for the report
        else:
            w.proc.kill()  # SIGKILL ends a stopped process too

    def kill_dumped(self, w: Worker) -> None:
        """SIGKILLs a hung rank whose stack dump had its time, and logs the stacks."""
        if w.kill_at is None:
            return
        w.kill_at = None
        if w.proc.poll() is None:
            w.proc.kill()
        self._log_stacks(w)

    def exited(self, w: Worker) -> None:
        """A worker died: if it was dumping its stacks, log what it wrote."""
        if w.kill_at is not None:
            w.kill_at = None
            self._log_stacks(w)

    def _log_stacks(self, w: Worker) -> None:
        stacks = self.stacks.collect(w.rank)
        self.events.emit("hang_stacks", rank=w.rank, pid=w.proc.pid, stacks=stacks or "(no dump written)")

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
