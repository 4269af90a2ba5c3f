"""Metrics sinks: a Prometheus text endpoint and TensorBoard scalars.

A sink receives a list of ``Sample``s (name, labels, value) with the training
step they belong to. Names follow Prometheus conventions: the
``resilient_train_`` prefix, base units (``_seconds``), ``_total`` for counters.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

__all__ = [
    "MetricsSink",
    "PrometheusSink",
    "Sample",
    "TensorBoardSink",
    "render_prometheus",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Sample:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)
    kind: str = "gauge"  # "gauge" or "counter"
    help: str = ""


class MetricsSink(Protocol):
    def write(self, samples: list[Sample], step: int) -> None: ...

    def close(self) -> None: ...


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def render_prometheus(samples: list[Sample]) -> str:
    """The text exposition format (version 0.0.4): one HELP/TYPE block per name."""
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    lines = []
    for name in sorted(by_name):
        group = by_name[name]
        lines.append(f"# HELP {name} {group[0].help or name}")
        lines.append(f"# TYPE {name} {group[0].kind}")
        for s in group:
            labels = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(s.labels.items()))
            lines.append(f"{name}{{{labels}}} {_number(s.value)}" if labels else f"{name} {_number(s.value)}")
    return "\n".join(lines) + "\n"


class PrometheusSink:
    """Serves the latest samples at ``http://host:port/metrics`` from a named thread."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._text = ""
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] not in ("/", "/metrics"):
                    self.send_error(404)
                    return
                with sink._lock:
                    body = sink._text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._server.timeout = 1.0
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
            name="resilient-train-prometheus", daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def write(self, samples: list[Sample], step: int) -> None:
        text = render_prometheus(samples)
        with self._lock:
            self._text = text

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5.0)
        self._server.server_close()


class TensorBoardSink:
    """Scalars under ``log_dir``; ``create`` returns ``None`` when no writer is importable."""

    def __init__(self, writer: object) -> None:
        self._writer = writer

    @classmethod
    def create(cls, log_dir: str) -> "TensorBoardSink | None":
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        except Exception:  # noqa: BLE001 (ImportError, or a broken install)
            try:
                from tensorboardX import SummaryWriter  # type: ignore[no-redef]
            except Exception:  # noqa: BLE001
                log.info("tensorboard is not installed: TensorBoard metrics are off")
                return None
        return cls(SummaryWriter(log_dir=log_dir))

    def write(self, samples: list[Sample], step: int) -> None:
        for s in samples:
            tag = s.name.removeprefix("resilient_train_")
            if s.labels:
                tag += "/" + ",".join(f"{k}{v}" for k, v in sorted(s.labels.items()))
            self._writer.add_scalar(tag, s.value, global_step=step)  # type: ignore[attr-defined]
        self._writer.flush()  # type: ignore[attr-defined]

    def close(self) -> None:
        self._writer.close()  # type: ignore[attr-defined]
