"""``DashboardServer``: the live page of one run, served by uvicorn from a named background thread.

One call starts it (the agent's ``--dashboard`` and ``resilient-train
dashboard`` alike) and ``close`` stops it::

    server = DashboardServer(run_dir, DashboardConfig(host="127.0.0.1", port=0)).start()  # prints URL and token
    ...
    server.close()

The listening socket is bound in the constructor, so a port in use fails
there, at once, and ``port`` is known before the thread starts. It binds to
loopback unless told otherwise. The token that guards the run's data and the
controls is made here (random, 192 bits) and printed once, on start; the page
reads it from the URL's fragment, which browsers never send to a server or
keep in logs, and sends it in a header with every request.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

__all__ = ["DashboardConfig", "DashboardServer", "DashboardUnavailable", "check_available"]

_MODULES = ("starlette", "uvicorn", "sse_starlette")


class DashboardUnavailable(RuntimeError):
    """The ``dashboard`` extra is not installed; the message says how to install it."""


def check_available() -> None:
    """Raises ``DashboardUnavailable`` (one line) when a library the server needs is missing."""
    import importlib.util

    missing = [m for m in _MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise DashboardUnavailable(
            f"the dashboard server needs {', '.join(missing)}: pip install 'resilient-train[dashboard]'")


@dataclass(kw_only=True)
class DashboardConfig:
    host: str = "127.0.0.1"  # the address it binds; loopback: only this machine's users reach it (and need the token to steer)
    port: int = 0  # 0 picks a free port (see DashboardServer.url)
    refresh_s: float = 1.0  # how often open pages get a new snapshot while the run's events change

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("DashboardConfig.host must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"DashboardConfig.port must be in [0, 65535], got {self.port}")
        if self.refresh_s <= 0:
            raise ValueError(f"DashboardConfig.refresh_s must be > 0, got {self.refresh_s}")


class DashboardServer:
    def __init__(self, run_dir: str | Path, config: DashboardConfig | None = None, *, token: str | None = None,
                 out: TextIO | None = None) -> None:
        check_available()
        self.config = config = config or DashboardConfig()
        self.run_dir = Path(run_dir)
        self.token = token or secrets.token_urlsafe(24)
        self._out = out
        self._stopping = threading.Event()
        self._sock = _bind(config.host, config.port)
        self.host, self.port = config.host, self._sock.getsockname()[1]
        self._thread: threading.Thread | None = None
        self._server: Any = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def url_with_token(self) -> str:
        return f"{self.url}#token={self.token}"

    def start(self) -> "DashboardServer":
        """Starts serving in a daemon thread and prints the URL and token; returns ``self``."""
        import uvicorn

        from monitors.dashboard.app import build_app

        if self._thread is not None:
            raise RuntimeError("DashboardServer.start: already started")
        app = build_app(self.run_dir, token=self.token, refresh_s=self.config.refresh_s, stopping=self._stopping,
                        loopback=_is_loopback(self.host))
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", ws="none",
                                timeout_graceful_shutdown=2, timeout_keep_alive=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="resilient-train-dashboard", daemon=True)
        self._thread.start()
        out = self._out or sys.stdout
        print(f"dashboard: {self.url_with_token}", file=out)
        print(f"dashboard token (reading the run and its controls need it): {self.token}", file=out)
        if not _is_loopback(self.host):
            print(f"dashboard: listening on {self.host}, reachable from other machines; "
                  "reading and steering still need the token (plain HTTP: use a trusted network)", file=out)
        out.flush()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Ends the live streams, stops the server and joins its thread (at most ``timeout`` seconds)."""
        self._stopping.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "DashboardServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name: let the resolver pick
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        except (socket.gaierror, UnicodeError) as e:
            raise ValueError(f"dashboard: cannot listen on {host}:{port}: not a known host or address "
                             f"({getattr(e, 'strerror', None) or e})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"dashboard: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
