"""The page: one HTML template, served live (assets by URL) or exported (assets and data inlined)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

__all__ = ["STATIC_DIR", "render_page"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
_ASSETS = ("dashboard.css", "echarts.min.js", "dashboard.js")


def _asset(name: str) -> str:
    return (STATIC_DIR / name).read_text(encoding="utf-8")


def render_page(*, data: dict[str, Any] | None, title: str) -> str:
    """``data=None``: the live page, which loads its assets from ``static/`` and its data from the
    stream. With ``data``: one self-contained document that needs no server and no network."""
    template = _asset("index.html")
    if data is None:
        style = '<link rel="stylesheet" href="static/dashboard.css">'
        scripts = '<script src="static/echarts.min.js"></script>\n<script src="static/dashboard.js"></script>'
        embedded = ""
    else:
        style = f"<style>\n{_asset('dashboard.css')}\n</style>"
        scripts = "\n".join(f"<script>\n{_inline_js(_asset(n))}\n</script>" for n in _ASSETS[1:])
        # JSON inside <script>: "</" must not appear, or the HTML parser ends the element early.
        text = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
        embedded = f'<script id="rt-data" type="application/json">{text}</script>'
    return (template.replace("{{TITLE}}", html.escape(title)).replace("{{STYLE}}", style)
            .replace("{{DATA}}", embedded).replace("{{SCRIPTS}}", scripts))


def _inline_js(code: str) -> str:
    return code.replace("</script", "<\\/script")
