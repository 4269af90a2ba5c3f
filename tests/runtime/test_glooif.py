"""Which interface the agent names for gloo (resilient_train.agent.glooif), in this machine's own network; inside
network namespaces, with addresses of their own: tests/cluster/test_netns.py."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from jobs import GPT
from monitors import EventLog
from resilient_train.agent.config import AgentConfig
from resilient_train.agent.glooif import gloo_interface, interface_of, source_address
from resilient_train.agent.workers import Workers
from resilient_train.agent.workerio import Console


def _has_ipv6_loopback() -> bool:
    try:
        return any(line.split()[-1] == "lo" for line in Path("/proc/net/if_inet6").read_text().splitlines())
    except OSError:
        return False


@pytest.mark.timeout(30)
def test_an_address_is_found_on_its_interface_and_a_loopback_store_gives_lo() -> None:
    assert gloo_interface("127.0.0.1") == gloo_interface("localhost") == gloo_interface("::1") == "lo"
    assert source_address("127.0.0.1") == "127.0.0.1" and interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.254") is None  # TEST-NET-3: held by no interface here
    assert interface_of("not an address") is None
    assert source_address("no-such-host.invalid") is None
    if _has_ipv6_loopback():
        assert interface_of("::1") == "lo" and source_address("::1") == "::1"
    # Whatever this machine's first non-loopback address is, it is found on the interface holding it.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # a route lookup only: nothing is sent
            mine = s.getsockname()[0]
        except OSError:
            mine = None
    if mine is not None:
        assert interface_of(mine) is not None and source_address("192.0.2.1") == mine


@pytest.mark.timeout(30)
def test_the_workers_get_the_interface_unless_the_user_named_one(tmp_path: Path, monkeypatch) -> None:
    def gloo_env(**kw: object) -> str | None:
        c = AgentConfig(script=str(GPT), run_dir=str(tmp_path), **kw)  # type: ignore[arg-type]
        workers = Workers(c, c.entry, run_dir=tmp_path, events=EventLog(None, source="agent"),
                          console=Console())  # type: ignore[arg-type]
        env = workers.env(0, 0, replacement=False, port=29500, token="t" * 32, attempt=0)
        return env.get("GLOO_SOCKET_IFNAME")

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert gloo_env() == "lo"
    assert gloo_env(master_addr="192.0.2.1") == gloo_interface("192.0.2.1")  # the route's interface, or None
    assert gloo_env(env={"GLOO_SOCKET_IFNAME": "ib0"}) == "ib0"  # the run config's environment wins
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert gloo_env() == "eth7"  # and so does the agent's own
