"""The hang monitor's computed timeouts outlive the agent: saved in the run directory, offered by checkpoints.

The hang detector learns each section's timeout from what it observes
(monitors.hang). That view is saved to ``RUN_DIR/.monitors/timeouts.json``
(``timeouts-nodeN.json`` for node N > 0) every ``monitor_state_every_s``, and
at once when a timeout changed; a job started again in the run directory
loads it. Rank 0 puts the file in each checkpoint it writes, and a rank that
resumes from a checkpoint (in another run directory, say) offers its copy
back (monitors.persist): the agent merges it once per job. A forged or stale
file is refused with one line and the detector keeps its defaults.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from monitors import EventLog, NodeMonitor
from monitors.persist import monitor_state_path, offered_state_path, take_offer
from resilient_train.agent.events import MonitorStateDue, MonitorStateOffered

__all__ = ["MonitorState"]

_CHANGED_SAVE_S = 0.5  # a changed timeout is saved at most this often


class MonitorState:
    """Loads, saves and merges one node's monitor state."""

    def __init__(self, run_dir: Path, *, every_s: float, events: EventLog, say: Callable[[str], None]) -> None:
        self.run_dir, self.every_s, self.events, self._say = run_dir, every_s, events, say
        self.path = monitor_state_path(run_dir)
        self.monitor: NodeMonitor | None = None
        self._saved_at = time.monotonic()
        self._offer_taken = False  # a checkpoint's monitor state was merged (once per job)

    def attach(self, monitor: NodeMonitor, node: int) -> None:
        """``monitor`` is this node's now (``node``'s): it starts from the state saved in the run directory."""
        self.monitor = monitor
        self.path = monitor_state_path(self.run_dir)
        if node > 0:
            self.path = self.path.with_name(f"timeouts-node{node}.json")
        try:
            if monitor.load_state(self.path) is not None:
                self.events.emit("monitor_state_loaded", path=str(self.path), source="run directory",
                                 timeouts_s=monitor.state_dict()["hang"]["timeouts_s"])
        except ValueError as e:  # a forged or stale file: the detector keeps its defaults, and says so once
            self.events.emit("monitor_state_ignored", path=str(self.path), reason=str(e))
            self._say(f"saved hang timeouts ignored: {e}")
        self._saved_at = time.monotonic()

    def poll(self) -> list[MonitorStateDue | MonitorStateOffered]:
        assert self.monitor is not None
        events: list[MonitorStateDue | MonitorStateOffered] = []
        if offered_state_path(self.run_dir).exists():
            events.append(MonitorStateOffered())
        # Changed timeouts are saved at once: rank 0 puts the saved file in each checkpoint it writes.
        since = time.monotonic() - self._saved_at
        if since >= self.every_s or (since >= _CHANGED_SAVE_S and self.monitor.timeouts_changed()):
            events.append(MonitorStateDue())
        return events

    def save(self) -> None:
        if self.monitor is None:
            return
        self._saved_at = time.monotonic()
        try:
            self.monitor.save_state(self.path)
        except OSError as e:  # a full disk must not stop the job
            self.events.emit("monitor_state_not_saved", path=str(self.path), reason=str(e))

    def take_offer(self) -> None:
        """Merges the monitor state a rank found in the checkpoint it resumed from (monitors.persist)."""
        assert self.monitor is not None
        path = offered_state_path(self.run_dir)
        if self._offer_taken:
            # Once per job: the first resume brought the saved view; later disk fallbacks in this job
            # would only count the same observations again.
            path.unlink(missing_ok=True)
            return
        self._offer_taken = True
        try:
            offer = take_offer(self.run_dir)
            if offer is None:
                return
            step, state = offer
            self.monitor.load_state_dict(state)
            self.events.emit("monitor_state_loaded", path=str(path), source="checkpoint", step=step,
                             timeouts_s=self.monitor.state_dict()["hang"]["timeouts_s"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.events.emit("monitor_state_ignored", path=str(path), reason=f"{type(e).__name__}: {e}")
            self._say(f"the checkpoint's hang timeouts are ignored: {e}")
