"""Headless Chromium for the dashboard tests: Debian's ``chromium`` driven by Playwright.

Browsers cannot be downloaded here, so Playwright's own build is never used:
the driver (shipped in the playwright wheel) launches the system binary. Each
browser gets a fresh profile, and no background network traffic of its own.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["CHROMIUM", "SKIP_REASON", "chromium"]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _skip_reason() -> str | None:
    if CHROMIUM is None:
        return "needs a Chromium binary (Debian: apt-get install chromium; .ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "needs playwright (pip install -e '.[test]')"
    return None


SKIP_REASON = _skip_reason()


@contextmanager
def chromium(*, offline: bool = False, width: int = 1400, height: int = 900) -> Iterator[Any]:
    """A page in a fresh persistent context; ``offline`` cuts the network off (file:// still loads)."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="rt-chromium-")
    try:
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, args=ARGS, headless=True,
                viewport={"width": width, "height": height}, offline=offline,
            )
            try:
                ctx.set_default_timeout(30_000)
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                page.errors = []  # type: ignore[attr-defined]
                page.on("pageerror", lambda e: page.errors.append(str(e)))  # type: ignore[attr-defined]
                yield page
            finally:
                ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
