"""Read-only views of a run: events, heartbeats, straggler scores, metrics sinks."""

from monitors.events import EventLog, read_events

__all__ = ["EventLog", "read_events"]
