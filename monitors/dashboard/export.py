"""``resilient-train dashboard RUN_DIR --export FILE``: the page of a run in one file.

The file holds the page, its script and style, ECharts and the run's data
(every heatmap metric, every incident), so it opens from disk with no server
and no network, and can be attached to a bug report. It needs none of the
``dashboard`` extra's libraries, so the chaos report can always write one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from monitors.dashboard.model import RunModel
from monitors.dashboard.page import render_page

__all__ = ["export_html", "export_html_text"]


def export_html_text(run_dir: str | os.PathLike[str]) -> str:
    model = RunModel(run_dir)
    model.refresh()
    data = model.snapshot(all_metrics=True)
    data["exported_at"] = time.time()
    return render_page(data=data, title=f"resilient-train: {Path(run_dir).resolve().name} (exported)")


def export_html(run_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Writes the self-contained page of ``run_dir`` to ``out`` (atomically) and returns its path."""
    if not Path(run_dir).is_dir():
        raise ValueError(f"no such run directory: {run_dir}")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(export_html_text(run_dir), encoding="utf-8")
    os.replace(tmp, path)
    return path
