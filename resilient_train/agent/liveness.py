"""A node's death seen at once: each agent holds one TCP connection to node 0's agent while it lives.

The beats (resilient_train.protocol.nodes) find a lost node ``--node-timeout`` after its
last beat, whatever killed it: a host that died, a link cut. But most losses
are the node's processes dying on a host that lives (an out-of-memory kill, a
crash, a scheduler's SIGKILL): the kernel then closes their sockets at once. So
node 0's agent, which hosts the store, also listens on a port of its own
(published in the store); every other agent connects once it registered and
says which node and incarnation it is, with a proof of the job's secret (an
HMAC of that line under the job token: a stranger who reaches the port can
neither pose as a node nor, by closing a connection, make one look lost), and
keeps the connection open without a thread. When a connection ends without the
agent having said ``bye`` (it does on its way out: the job done, fenced,
stopped), that incarnation of the node is lost now: node 0's agent claims the
loss as a beat timeout would, milliseconds after the death instead of seconds.
"""

from __future__ import annotations

import hashlib
import hmac
import select
import socket
import threading
import time

import torch.distributed as dist

__all__ = ["LivenessClient", "LivenessServer"]

_KEY = "rt/node/liveness"  # node 0's listening port
_HELLO_MAX = 256
_STEP_S = 0.1  # the server thread's wait between looks (it wakes at once on a closed connection)


def _mac(token: str, line: str) -> str:
    return hmac.new(token.encode(), line.encode(), hashlib.sha256).hexdigest()


class LivenessServer:
    """Node 0's agent: accepts the other agents' connections and notes those that end without a ``bye``."""

    def __init__(self, store: dist.Store, token: str, host: str) -> None:
        self._token = token
        self._sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setblocking(False)
        store.set(_KEY, str(self._sock.getsockname()[1]))
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, tuple[int, int] | None] = {}  # -> (node, incarnation) once it said hello
        self._buf: dict[socket.socket, bytes] = {}
        self._bye: set[socket.socket] = set()
        self._lost: list[tuple[int, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rt-liveness", daemon=True)
        self._thread.start()

    def lost(self) -> list[tuple[int, int]]:
        """The (node, incarnation) whose connection ended without a bye since the last call."""
        with self._lock:
            out, self._lost = [(n, i) for n, i, _ in self._lost], []
        return out

    def _loop(self) -> None:
        while not self._stop.is_set():
            watched = [self._sock, *self._conns]
            try:
                ready, _, _ = select.select(watched, [], [], _STEP_S)
            except (OSError, ValueError):
                continue
            for s in ready:
                if s is self._sock:
                    self._accept()
                else:
                    self._read(s)

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        conn.setblocking(False)
        self._conns[conn] = None
        self._buf[conn] = b""

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(_HELLO_MAX)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._closed(conn)
            return
        self._buf[conn] += data
        while b"\n" in self._buf[conn]:
            line, self._buf[conn] = self._buf[conn].split(b"\n", 1)
            self._line(conn, line.decode(errors="replace"))
        if len(self._buf[conn]) > _HELLO_MAX:
            self._closed(conn, trusted=False)

    def _line(self, conn: socket.socket, line: str) -> None:
        if line == "bye":
            self._bye.add(conn)
            return
        parts = line.split()
        if len(parts) == 4 and parts[0] == "hello" and hmac.compare_digest(
                parts[3], _mac(self._token, " ".join(parts[:3]))):
            self._conns[conn] = (int(parts[1]), int(parts[2]))
        else:
            self._closed(conn, trusted=False)  # not one of the job's agents: dropped, nothing noted

    def _closed(self, conn: socket.socket, *, trusted: bool = True) -> None:
        who = self._conns.pop(conn, None)
        self._buf.pop(conn, None)
        said_bye = conn in self._bye
        self._bye.discard(conn)
        conn.close()
        if trusted and who is not None and not said_bye:
            with self._lock:
                self._lost.append((who[0], who[1], time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        for conn in list(self._conns):
            conn.close()
        self._sock.close()


class LivenessClient:
    """Another node's agent: one connection to node 0's agent, held open while it lives."""

    def __init__(self, store: dist.Store, token: str, host: str, node: int, incarnation: int) -> None:
        port = int(store.get(_KEY).decode())
        self._sock = socket.create_connection((host, port), timeout=10.0)
        line = f"hello {node} {incarnation}"
        self._sock.sendall(f"{line} {_mac(token, line)}\n".encode())

    def close(self) -> None:
        """Says ``bye`` (this is no loss) and closes."""
        try:
            self._sock.sendall(b"bye\n")
        except OSError:
            pass
        self._sock.close()
