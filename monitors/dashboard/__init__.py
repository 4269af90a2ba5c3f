"""The straggler and recovery dashboard: a live page for a running job, and a self-contained export.

``RunModel`` reads ``RUN_DIR/events.jsonl`` incrementally and aggregates it
(worst-k ranks, per-fault recovery timelines, checkpoints); ``DashboardServer``
serves the page and its API (the ``dashboard`` extra: Starlette, uvicorn,
sse-starlette); ``export_html`` writes the page with its data and the vendored
charting library into one file that opens without a server or a network.
"""

from monitors.dashboard.export import export_html
from monitors.dashboard.model import RunModel
from monitors.dashboard.server import DashboardConfig, DashboardServer, DashboardUnavailable

__all__ = ["DashboardConfig", "DashboardServer", "DashboardUnavailable", "RunModel", "export_html"]
