"""The step-progress plot of a scenario run (``progress.png``), drawn with matplotlib's Agg backend.

matplotlib is imported here, lazily, so the core install stays small: without
it ``progress_plot`` raises ``PlotUnavailable`` with a one-line message (the
``chaos`` extra installs it) and the report is written without the plot.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BLUE", "GREEN", "ORANGE", "PlotUnavailable", "RED", "progress_plot"]

RGB = tuple[int, int, int]
BLUE = (30, 90, 200)
RED, ORANGE, GREEN = (220, 30, 30), (240, 150, 0), (20, 160, 60)
_DPI = 100


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def progress_plot(
    path: Path, steps: list[tuple[float, int]], marks: list[tuple[float, RGB]], *, total_s: float, total_steps: int,
    width: int = 900, height: int = 360,
) -> None:
    """Step (y) over seconds since launch (x); a vertical line per mark; ``width`` x ``height`` pixels.

    Grid lines every 10 s on x (60 s darker), every tenth of the steps on y.
    """
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot state, safe in threads
        from matplotlib.ticker import MultipleLocator
    except ImportError:
        raise PlotUnavailable("progress.png needs matplotlib: pip install 'resilient-train[chaos]'") from None

    fig = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    ax = fig.add_subplot()
    xs = max(total_s, 1e-6)
    ys = max(total_steps, 1)
    ax.set_xlim(0, xs)
    ax.set_ylim(0, ys * 1.02)
    ax.xaxis.set_major_locator(MultipleLocator(60 if xs > 120 else 10))
    ax.xaxis.set_minor_locator(MultipleLocator(10))
    ax.yaxis.set_major_locator(MultipleLocator(max(ys / 10, 1)))
    ax.grid(True, which="major", color="#c8c8c8", linewidth=0.9)
    ax.grid(True, which="minor", axis="x", color="#e4e4e4", linewidth=0.6)
    for t_mark, colour in marks:
        ax.axvline(t_mark, color=_colour(colour), linewidth=1.6)
    if steps:
        ax.plot([t for t, _ in steps], [s for _, s in steps], color=_colour(BLUE), linewidth=1.8)
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("step (rank 0)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(Path(path), format="png")


def _colour(c: RGB) -> tuple[float, float, float]:
    return (c[0] / 255, c[1] / 255, c[2] / 255)
