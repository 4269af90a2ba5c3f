"""The dashboard's web app (Starlette): the page, its data, a live stream, and the controls.

Routes:

- ``GET /``: the page, an empty shell (its title names no run); ``GET /static/...``:
  its script, style and ECharts. Nothing of the run: served to anyone;
- ``GET /api/state?metric=M``: a snapshot (``RunModel.snapshot``) as JSON;
- ``GET /api/stream?metric=M``: the same snapshot as server-sent events, pushed
  every ``refresh_s`` while the run's events change;
- ``GET /api/export``: the self-contained page of the run as it is now (its
  stacks and error texts included);
- ``POST /api/straggler``: ``{"enabled": bool, "threshold": float}`` (either)
  writes the run-time control the straggler detector reads at its next report
  (``monitors.control``).

Every ``/api/`` route, reads included, needs the ``X-Dashboard-Token`` header to
equal the server's token; anything else is refused with 403, reads nothing and
changes nothing. The run directory is private to its owner (``0o700``): the
dashboard must not hand its content to any local user who finds the port. The
header also keeps other web pages out: a cross-origin request with a custom
header needs a CORS preflight this app never grants.

Bound to loopback, the app answers only requests addressed to a loopback name
(``Host: 127.0.0.1``, ``localhost``, ``[::1]``): a web page that rebinds its own
domain to 127.0.0.1 cannot read the run through the browser of someone who
visits it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from monitors.control import write_control
from monitors.dashboard.export import export_html_text
from monitors.dashboard.model import RunModel
from monitors.dashboard.page import STATIC_DIR, render_page
from monitors.dashboard.scores import METRICS
from monitors.events import EventLog

__all__ = ["TOKEN_HEADER", "build_app"]

TOKEN_HEADER = "X-Dashboard-Token"
_KEEPALIVE_S = 5.0  # a snapshot is pushed at least this often, so ages and running bars move on


class _Feed:
    """One model shared by every client: refreshed at most once per ``refresh_s``, each snapshot
    serialised once per version and metric however many pages are open."""

    def __init__(self, model: RunModel, refresh_s: float) -> None:
        self.model = model
        self.refresh_s = refresh_s
        self._refreshed = -1e9
        self._lock = asyncio.Lock()
        self._cache: dict[str, tuple[int, float, str]] = {}

    async def state(self, metric: str, *, fresh: bool = False) -> tuple[int, str]:
        async with self._lock:
            now = time.monotonic()
            if fresh or now - self._refreshed >= self.refresh_s / 2:
                self._refreshed = now
                await anyio.to_thread.run_sync(self.model.refresh)  # a large backlog must not block the loop
            hit = self._cache.get(metric)
            if hit is not None and hit[0] == self.model.version and now - hit[1] < _KEEPALIVE_S and not fresh:
                return hit[0], hit[2]
            version = self.model.version
            text = await anyio.to_thread.run_sync(lambda: json.dumps(self.model.snapshot(metric=metric)))
            self._cache[metric] = (version, now, text)
            return version, text


_LOOPBACK_NAMES = ["127.0.0.1", "localhost", "::1", "[::1]"]


def build_app(run_dir: str | Path, *, token: str, refresh_s: float = 1.0,
              stopping: threading.Event | None = None, loopback: bool = True) -> Starlette:
    """The app for one run directory. ``stopping`` ends the live streams (set it before shutting down)."""
    model = RunModel(run_dir)
    feed = _Feed(model, refresh_s)
    stopping = stopping or threading.Event()
    events = EventLog(Path(run_dir) / "events.jsonl", source="dashboard")

    def refused(request: Request) -> Response | None:
        """None with the server's token in the request's header, else the 403 to answer."""
        given = request.headers.get(TOKEN_HEADER, "")
        if hmac.compare_digest(given.encode(), token.encode()):
            return None
        return JSONResponse({"ok": False, "error": f"missing or wrong {TOKEN_HEADER}"}, status_code=403)

    async def page(request: Request) -> Response:
        return HTMLResponse(render_page(data=None, title="resilient-train dashboard"),
                            headers={"Cache-Control": "no-store"})

    async def state(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        metric = _metric(request)
        if metric is None:
            return _bad(f"unknown metric; expected one of {', '.join(METRICS)}")
        _, text = await feed.state(metric)
        return Response(text, media_type="application/json", headers={"Cache-Control": "no-store"})

    async def stream(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        metric = _metric(request)
        if metric is None:
            return _bad(f"unknown metric; expected one of {', '.join(METRICS)}")

        async def gen() -> AsyncIterator[dict[str, str]]:
            sent, pushed = None, 0.0
            while True:
                # On shutdown (the agent closes it as the job ends), one last push: the job's end.
                last = stopping.is_set()
                version, text = await feed.state(metric, fresh=last)
                if last or version != sent or time.monotonic() - pushed >= _KEEPALIVE_S:
                    yield {"event": "state", "data": text}
                    sent, pushed = version, time.monotonic()
                if last:
                    return
                await anyio.sleep(refresh_s)

        return EventSourceResponse(gen(), ping=15, send_timeout=10, headers={"Cache-Control": "no-store"})

    async def export(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        text = await anyio.to_thread.run_sync(lambda: export_html_text(run_dir))
        name = f"{Path(run_dir).resolve().name}-dashboard.html"
        return HTMLResponse(text, headers={"Content-Disposition": f'attachment; filename="{name}"'})

    async def straggler(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        try:
            body: Any = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _bad("the body must be a JSON object")
        if not isinstance(body, dict) or not body or set(body) - {"enabled", "threshold"}:
            return _bad('expected {"enabled": true|false} and/or {"threshold": a number in (0, 1]}')
        enabled, threshold = body.get("enabled"), body.get("threshold")
        if enabled is not None and not isinstance(enabled, bool):
            return _bad("enabled must be true or false")
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0 < threshold <= 1):
            return _bad("threshold must be a number in (0, 1]")
        ctl = write_control(run_dir, enabled=enabled, threshold=None if threshold is None else float(threshold))
        written = events.emit("straggler_control", enabled=ctl.enabled, threshold=ctl.threshold,
                              changed=sorted(body))
        return JSONResponse({"ok": True, "requested": {"enabled": ctl.enabled, "threshold": ctl.threshold},
                             "at": written["time"], "note": "takes effect at the detector's next report"})

    return Starlette(routes=[
        Route("/", page),
        Route("/api/state", state),
        Route("/api/stream", stream),
        Route("/api/export", export),
        Route("/api/straggler", straggler, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ], middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=_LOOPBACK_NAMES)] if loopback else [])


def _metric(request: Request) -> str | None:
    m = request.query_params.get("metric", "relative")
    return m if m in METRICS else None


def _bad(why: str) -> Response:
    return JSONResponse({"ok": False, "error": why}, status_code=400)
