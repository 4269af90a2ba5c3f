"""The network-namespace harness itself (tests/cluster/netns.py): nodes with their own addresses and names, links
cut and restored, partitions, a node killed whole, and nothing left behind; and gloo's interface, chosen by the
agent, inside a node."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.netns import ETC_NETNS, Network, Node, _netns_pids, alive
from jobs import REPO

# A node's TCP listener: accepts and closes connections until killed; says "ready" once it listens.
LISTEN = ("import socket, sys\n"
          "s = socket.socket(); s.bind((sys.argv[1], 7000)); s.listen(64)\n"
          "print('ready', flush=True)\n"
          "while True:\n"
          "    s.accept()[0].close()\n")


def _listen(node: Node) -> subprocess.Popen:
    p = node.popen([sys.executable, "-c", LISTEN, node.address], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _reaches(src: Node, dst: Node, timeout_s: float = 5.0) -> bool:
    """A TCP connection from ``src`` to ``dst``'s listener is made within ``timeout_s`` (bash's /dev/tcp)."""
    argv = ["timeout", str(timeout_s), "bash", "-c", f"exec 3<>/dev/tcp/{dst.address}/7000"]
    return src.run(argv, capture_output=True).returncode == 0


def _cut_off(src: Node, dst: Node) -> bool:
    """No connection from ``src`` to ``dst``'s listener within 0.5 s (over a working link one takes
    microseconds, once the client has started)."""
    return not _reaches(src, dst, 0.5)


def _links(net: Network) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [line.split(": ", 2)[1].split("@")[0] for line in out.splitlines() if net.id in line]


@pytest.mark.timeout(120)
def test_each_node_has_its_address_and_name_links_cut_and_restore_and_partitions_split_and_heal(network):
    net = network(3)
    a, b, c = net["node0"], net["node1"], net["node2"]
    assert len({n.address for n in net.nodes.values()}) == 3
    for node in (a, b, c):
        said = node.run(["sh", "-c", "hostname; ip -o -4 addr show eth0; getent hosts node0 node1"],
                        capture_output=True, text=True, check=True).stdout.splitlines()
        assert said[0] == node.name and f"inet {node.address}/24" in said[1], said
        # Every node knows the others by name; its own name is loopback first (Debian's 127.0.1.1).
        assert said[2].split() == ["127.0.1.1" if node is a else a.address, "node0"], said
    listeners = [_listen(n) for n in (a, b, c)]
    assert all(_reaches(x, y) for x in (a, b, c) for y in (a, b, c) if x is not y)
    b.cut()  # the bridge's end: b's peers hear nothing of it, and it of them
    assert _cut_off(a, b) and _cut_off(b, a) and _cut_off(c, b) and _reaches(a, c)
    b.restore()
    assert _reaches(a, b) and _reaches(b, a)
    c.cut(inside=True)  # its own interface
    assert _cut_off(a, c) and _cut_off(c, a) and _reaches(a, b)
    c.restore()
    assert _reaches(a, c)
    net.partition(["node0"], ["node1", "node2"])
    assert _reaches(b, c) and _reaches(c, b) and _cut_off(a, b) and _cut_off(c, a)
    net.heal()
    assert all(_reaches(x, y) for x in (a, b, c) for y in (a, b, c) if x is not y)
    killed = b.kill()  # every process of the node: its listener
    assert listeners[1].pid in killed and listeners[1].poll() is not None and not b.pids()
    assert not _reaches(a, b)  # nobody listens there now: refused at once
    assert a.pids() == [listeners[0].pid] and alive(listeners[2].pid)


@pytest.mark.timeout(60)
def test_close_leaves_nothing_behind_even_with_processes_running_and_links_cut(network):
    net = network(2)
    node = net["node1"]
    sleepers = [node.popen(["sleep", "600"]) for _ in range(2)]
    orphan = node.popen(["sh", "-c", "sleep 600 & sleep 600"])  # a child the harness never saw
    node.cut()
    net.partition(["node0"], ["node1"])
    deadline = time.monotonic() + 30
    while len(node.pids()) < 4:  # each enters the namespace once `ip netns exec` has run
        assert time.monotonic() < deadline, node.pids()
        time.sleep(0.02)
    assert _links(net)
    net.close()
    assert all(p.poll() is not None for p in [*sleepers, orphan])
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert net.id not in listed and not _links(net)
    assert not list(ETC_NETNS.glob(f"{net.id}-*"))  # the hosts files
    net.close()  # twice: nothing left to do


@pytest.mark.timeout(60)
def test_the_agent_gives_gloo_the_interface_its_node_reaches_the_store_over(network):
    """In a node, the host name resolves to loopback (as on Debian), so gloo's own choice offers peers
    127.0.0.1; the agent names the interface that carries the route to the store's address instead, on node
    0 (the address is its own) and on the others."""
    net = network(2)
    # The module alone (standard library only): the package would import torch, seconds on 2 busy cores.
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('glooif', sys.argv[2]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); g = m.gloo_interface; "
            "print(g(sys.argv[1]), g('127.0.0.1'), g('localhost'), g('no-such-host.invalid'), g('10.255.0.1'))")
    module = REPO / "resilient_train" / "agent" / "glooif.py"
    for node in net.nodes.values():
        out = node.run([sys.executable, "-c", code, net["node0"].address, str(module)], capture_output=True,
                       text=True, check=True).stdout.split()
        # A node without a route to an address gets None: gloo keeps its own choice.
        assert out == ["eth0", "lo", "lo", "None", "None"], (node.name, out)


LEAVE_BEHIND = """
import os, signal, subprocess, sys
sys.path.insert(0, sys.argv[1])
from cluster.netns import Network
net = Network(2)
net["node1"].popen(["sleep", "600"], stdout=subprocess.DEVNULL)
print(net.id, " ".join(n.netns for n in net.nodes.values()), flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)  # a test process killed before its close
"""


@pytest.mark.timeout(60)
def test_what_a_killed_test_process_left_behind_is_removed_by_the_next_network(network):
    tests = Path(__file__).resolve().parent.parent
    p = subprocess.Popen([sys.executable, "-c", LEAVE_BEHIND, str(tests)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    left_id, *left_ns = p.stdout.readline().split()  # type: ignore[union-attr]
    deadline = time.monotonic() + 30
    while not [pid for pid in _netns_pids(left_ns[1]) if alive(pid)]:  # its sleep entered the namespace
        assert time.monotonic() < deadline
        time.sleep(0.02)
    [sleeper] = [pid for pid in _netns_pids(left_ns[1]) if alive(pid)]
    p.communicate("go\n", timeout=30)
    assert p.returncode == -9
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert all(ns in listed for ns in left_ns)
    network(1)  # sweeps first
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert not any(ns in listed for ns in left_ns) and left_id not in links and not alive(sleeper)
    assert not list(ETC_NETNS.glob(f"{left_id}-*"))
