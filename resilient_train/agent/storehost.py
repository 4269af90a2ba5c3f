"""The coordination store as the agent holds it: hosted by node 0's agent, reached by the others.

Node 0's agent (or a one-node job's) hosts a TCPStore without libuv on a
socket it opened itself on ``--master-addr`` only (loopback by default), so a
port in use is one line before anything starts. Every key of the job lives
under its secret namespace (resilient_train.protocol.jobtoken) and under the attempt
(torchrun's restart count). A restart of every worker gets a fresh store on
the same port: the last attempt's keys (its process group's among them) must
not be met again, and a script that was given a port keeps it.
"""

from __future__ import annotations

import errno
import gc
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from resilient_train.protocol import env as E
from resilient_train.agent import fdlimit
from resilient_train.protocol.succession.location import call_timeout_s
from resilient_train.agent.config import AgentConfig
from resilient_train.agent.state import AgentError
from resilient_train.agent.succession import AgentSuccession
from resilient_train.protocol.jobtoken import check_fingerprint, publish_fingerprint, shared_token
from resilient_train.protocol.store import Keys, attempt_store, job_store, new_token
from resilient_train.protocol.succession.location import Endpoint, StoreLocation
from resilient_train.protocol.succession.movable import MovableStore

__all__ = ["StoreHost", "job_token"]

STORE_TIMEOUT = timedelta(seconds=60)  # of a blocking get or wait on the agent's connections


class StoreHost:
    """This agent's view of the store: ``store`` (the attempt's keys), ``port``, ``token``."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.hosting = config.node_rank == 0 and not config.spare  # node 0's agent hosts the store
        self.attempt = 0
        self.token, self.token_source = job_token(config)
        self._server: dist.Store | None = None  # the server (hosting) or this agent's first client connection
        self.fd_warning: str | None = None  # the open-file limit is short of the job's connections (fdlimit)
        self.location: StoreLocation | None = None  # another node's agent: where the store is now
        # Many nodes: every agent keeps a standby store and its place in the succession (agent.succession).
        self.succession: AgentSuccession | None = None
        if self.hosting:
            self.fd_warning = fdlimit.raise_for_store(config.nnodes * config.nproc_per_node)
            self.store = self._host(config.master_port)
            self.port: int = self._server.port  # type: ignore[union-attr]  (every attempt keeps it)
        else:
            self.port = config.master_port
            try:
                client = dist.TCPStore(config.master_addr, self.port, is_master=False, timeout=STORE_TIMEOUT)
            except (RuntimeError, OSError) as e:
                raise AgentError(f"cannot reach the store on {config.master_addr}:{config.master_port} (node 0's "
                                 f"agent): {str(e).splitlines()[0]}") from None
            try:  # the same secret as node 0's, or nothing this node writes would be read
                check_fingerprint(client, self.token, source=self.token_source)
            except ValueError as e:
                raise AgentError(str(e)) from None
            del client
            # Node 0's agent may stop answering without closing the connection: every call ends by a deadline;
            # and the store may move to a successor (resilient_train.agent.succession): every connection follows.
            # An agent reads keys that are there (a get waits for a missing one): a get past a call's deadline
            # too is the store lost, not a wait of a minute on a host that is gone.
            deadline = call_timeout_s(config.node_timeout_s)
            self.location = StoreLocation(Endpoint(config.master_addr, self.port), wrap=self.wrap,
                                          timeout=timedelta(seconds=deadline), call_timeout_s=deadline)
            self.store = MovableStore(self.location)  # type: ignore[assignment]
        if config.nnodes > 1:
            self.succession = AgentSuccession(master_addr=config.master_addr, token=self.token,
                                              node_timeout_s=config.node_timeout_s, hosting=self.hosting,
                                              wrap=self.wrap, source=self.token_source)

    @property
    def address(self) -> str:
        if self.location is not None:
            return str(self.location.endpoint)
        return f"{self.config.master_addr}:{self.port}"

    @property
    def endpoint(self) -> Endpoint:
        """Where the store is now (what a rank spawned now connects to)."""
        if self.location is not None:
            return self.location.endpoint
        return Endpoint(self.config.master_addr, self.port)

    def wrap(self, raw: dist.Store) -> dist.Store:
        """The job's keys on a raw store: its secret namespace, this attempt's."""
        return attempt_store(job_store(raw, self.token), self.attempt)

    def moved(self, endpoint: Endpoint, *, hosting: bool) -> None:
        """The store moved to ``endpoint`` (this agent's own standby store when ``hosting``)."""
        assert self.location is not None
        moved = self.location.move(endpoint)
        assert moved, (endpoint, self.location.endpoint)  # an agent's moves go one way, one at a time
        self.hosting = hosting

    def connect(self) -> dist.Store:
        """A connection of its own to the store, in the job's namespace (a heartbeat's)."""
        if self.location is not None:
            return MovableStore(self.location)
        c = self.config
        try:
            store = dist.TCPStore(c.master_addr, self.port, is_master=False, timeout=STORE_TIMEOUT)
        except (RuntimeError, OSError) as e:
            raise AgentError(f"cannot reach the store on {c.master_addr}:{c.master_port} (node 0's agent): "
                             f"{str(e).splitlines()[0]}") from None
        return self.wrap(store)

    def rehost(self) -> dist.Store:
        """The next attempt's store, on the same port (the old server is closed first); returns it."""
        assert self.hosting, "only the hosting agent restarts every worker"
        self.attempt += 1
        # Every reference to the old server goes first, or the port is still taken: the caller dropped its own.
        self.store = self._server = None  # type: ignore[assignment]
        gc.collect()
        self.store = self._host(self.port)
        return self.store

    def close(self) -> None:
        self.store = self._server = None  # type: ignore[assignment]

    def _host(self, port: int) -> dist.Store:
        """Hosts a fresh store on ``--master-addr`` only, under a fresh secret namespace (one node)."""
        addr = self.config.master_addr
        try:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
            sock.listen(4096)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AgentError(f"port {port} is already in use (pick another --master-port, or 0 for a free one)") from None
            raise AgentError(f"cannot host the coordination store on {addr}:{port}: {e.strerror or e}") from None
        try:
            store = dist.TCPStore(addr, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                                  timeout=STORE_TIMEOUT, master_listen_fd=sock.detach(), use_libuv=False)
        except (RuntimeError, OSError) as e:
            raise AgentError(f"cannot host the coordination store on port {port}: {str(e).splitlines()[0]}") from None
        self._server = store  # keeps the server alive; the agent itself talks through an attempt's keys
        if self.config.nnodes == 1:
            self.token = new_token()  # a fresh secret namespace each attempt
        else:
            publish_fingerprint(store, self.token)
        view = attempt_store(job_store(store, self.token), self.attempt)
        view.set(Keys.GENERATION, "0")
        return view


def job_token(config: AgentConfig) -> tuple[str, str]:
    """The job's secret namespace in the store and where it came from; the agents of a many-node job share it
    (resilient_train.protocol.jobtoken: never derived from --rdzv-id, which ``ps`` shows)."""
    if config.nnodes == 1:
        return new_token(), "drawn by the agent"
    try:
        return shared_token(token_file=config.job_token_file, environ_token=os.environ.get(E.RT_JOB_TOKEN),
                            run_dir=Path(config.run_dir))
    except ValueError as e:
        raise AgentError(str(e)) from None
