"""Nodes with addresses of their own on this one machine: a network namespace per node, a bridge between them.

Each :class:`Node` is a network namespace with loopback up and one veth pair:
``eth0`` inside (its own address in a private /24 the harness picked), the
other end a port of the network's bridge in the root namespace. Programs run
in it through ``ip netns exec`` and ``unshare --uts`` with a host name of
their own (``node0``, ``node1``, ...). Every node's ``/etc/hosts`` (``ip
netns exec`` lays ``/etc/netns/NS/hosts`` over it) names every node, its own
name first as ``127.0.1.1``, Debian's way: a program that trusts its host
name to find its address (gloo does) is met with loopback, as on many real
hosts. Names come from that file alone (its ``nsswitch.conf``: no DNS server
is on this network). The root namespace has no address on the bridge:
nothing outside the nodes can reach them, and two networks made at once (two
test sessions) never meet, whatever their subnets.

Faults, all real: :meth:`Node.cut` takes a node's link down (the bridge's
end: the cable pulled at the switch, the node sees only silence; or
``inside``: its own interface), :meth:`Node.restore` brings it back;
:meth:`Network.partition` moves each group's bridge ports to a bridge of its
own (no packet crosses between groups; within one they flow), and
:meth:`Network.heal` puts them back; :meth:`Node.kill` SIGKILLs every process
in the node's namespace at once (``ip netns pids``), as a host that dies.

:meth:`Network.close` (also on leaving its ``with``) kills every process of
every node, then removes the namespaces, the veths, the bridges and the hosts
files, whatever state the test left them in, and fails if anything is left.
Names carry the creating process's pid (``rtn<pid>-<n>-node0``, in base 36:
interface names have 15 characters at most), so a network left behind by a
test process that was itself killed is removed by the next one
(:func:`sweep`). :func:`unavailable` says why namespaces cannot be made here
(not root, no ``ip``/``unshare``, a kernel or sandbox without them), for a
skip.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Network", "Node", "alive", "sweep", "unavailable"]

ETC_NETNS = Path("/etc/netns")
IFNAME = "eth0"  # a node's interface, inside its namespace
_PREFIX = "rtn"  # every namespace this harness makes: rtn<pid>-<n>-<node>
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p


_unavailable: list[str | None] = []


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces (a skip's reason), or None: it can (probed once)."""
    if not _unavailable:
        _unavailable.append(_probe())
    return _unavailable[0]


def _probe() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add, a bridge, veth pairs)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"no `{tool}` on this machine (Debian: apt-get install {package})"
    try:
        with Network(1) as net:
            ran = net["node0"].run(["true"], capture_output=True, text=True)
            if ran.returncode != 0:  # ip netns exec, then unshare --uts and hostname
                return f"cannot run a program in a node's namespace with its own host name: {ran.stderr.strip()}"
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"cannot make a network namespace with a veth on a bridge here: {str(e).splitlines()[0]}"
    return None


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


_NODE_NAME = re.compile(r"[a-z][a-z0-9]{0,30}")  # a host name
_NETNS_NAME = re.compile(rf"{_PREFIX}([0-9a-z]+)-[0-9a-z]+-{_NODE_NAME.pattern}")  # what Network names
_LINK_NAME = re.compile(rf"{_PREFIX}([0-9a-z]+)-[0-9a-z]+-(b\d*|v\d+|p\d+)")


def _owner(name: str, pattern: re.Pattern[str]) -> int | None:
    """The pid of the test process that made ``name`` (a namespace or a link of this harness), or None."""
    m = pattern.fullmatch(name)
    return int(m.group(1), 36) if m else None


def sweep() -> list[str]:
    """Removes what networks of test processes no longer alive left behind (killed before their close);
    returns the namespaces and links removed."""
    removed = []
    for ns in _ip("netns", "list", check=False).stdout.split():
        pid = _owner(ns, _NETNS_NAME)
        if pid is None or Path(f"/proc/{pid}").exists():
            continue
        try:
            _kill_netns(ns)
        except RuntimeError:
            continue
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        removed.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(": ", 2)[1].split("@")[0] if line.count(": ") >= 2 else ""
        pid = _owner(name, _LINK_NAME)
        if pid is not None and not Path(f"/proc/{pid}").exists():
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _nsswitch() -> str:
    """The machine's nsswitch.conf with host names looked up in files only."""
    try:
        lines = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        lines = []
    lines = [line for line in lines if not line.split(":", 1)[0].strip() == "hosts"]
    return "\n".join([*lines, "hosts: files"]) + "\n"


def _netns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def _kill_netns(ns: str, timeout_s: float = 10.0, also: Sequence[int] = ()) -> list[int]:
    """SIGKILLs every process in ``ns`` until none is left, and ``also`` (processes started for it that may not
    have entered it yet: ``ip netns exec`` before its setns); returns their pids."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        pids = sorted({p for p in [*_netns_pids(ns), *also] if alive(p)})
        if not pids:
            return killed
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of {ns} outlived SIGKILL for {timeout_s:g} s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


@dataclass
class Node:
    """One node: a namespace, its address, its host name, its bridge port."""

    name: str  # its host name, and its name in the test: node0, node1, ...
    netns: str
    address: str
    port: str  # the veth's end on the bridge, in the root namespace
    network: "Network" = field(repr=False)
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    is_cut: bool = False
    bridge: str = ""  # the bridge its port is on (the network's, or a partition's)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run in this node: its namespace and its host name."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Starts ``argv`` in this node (a session of its own unless told otherwise); :meth:`kill` and the
        network's close end it and reap it."""
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(self.command(argv), **kwargs)
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], *, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)

    def pids(self) -> list[int]:
        """Every live process in this node's namespace."""
        return [p for p in _netns_pids(self.netns) if alive(p)]

    def kill(self) -> list[int]:
        """SIGKILLs every process of this node at once (its host died); returns their pids."""
        killed = _kill_netns(self.netns, also=[p.pid for p in self.procs if p.poll() is None])
        self._reap()
        return killed

    def cut(self, *, inside: bool = False) -> None:
        """Takes this node's link down: the bridge's end (default: its peers and it hear nothing more of each
        other, and it is not told) or its own interface (``inside``: it sees its link go)."""
        if inside:
            _ip("-n", self.netns, "link", "set", IFNAME, "down")
        else:
            _ip("link", "set", self.port, "down")
        self.is_cut = True

    def restore(self, timeout_s: float = 10.0) -> None:
        """Brings both ends of this node's link up again, and returns once packets cross it: the kernel takes
        a carrier's return into account up to a second later (linkwatch) and drops packets until then, with no
        sign of it in the link's state. The probe: a TCP connection to a closed port of a node on the same
        bridge, which answers (refused) only when packets flow both ways."""
        _ip("link", "set", self.port, "up")
        _ip("-n", self.netns, "link", "set", IFNAME, "up")
        self.is_cut = False
        peer = self.network.peer_of(self)
        deadline = time.monotonic() + timeout_s
        while peer is not None and not self._answered_by(peer):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}'s link carries nothing {timeout_s:g} s after its restore")

    def _answered_by(self, peer: "Node") -> bool:
        p = subprocess.run(["ip", "netns", "exec", self.netns, "timeout", "0.2", "bash", "-c",
                            f"exec 3<>/dev/tcp/{peer.address}/9"], capture_output=True, text=True, timeout=30)
        return p.returncode == 0 or "refused" in p.stderr

    def _reap(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


class Network:
    """``nodes`` nodes (a count, or their names) on one bridge; a context manager that removes all of it."""

    def __init__(self, nodes: int | Sequence[str]) -> None:
        names = [f"node{i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
        if len(names) > 99:
            raise ValueError("at most 99 nodes")
        bad = [n for n in names if not _NODE_NAME.fullmatch(n)]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"node names must be distinct host names (a-z, 0-9): {names}")
        # Every name carries the pid (sweep), in base 36: interface names have 15 characters at most.
        self.id = f"{_PREFIX}{_base36(os.getpid())}-{_base36(next(_counter))}"
        self.bridge = f"{self.id}-b"
        self.subnet = f"10.213.{random.randrange(1, 255)}"
        self.nodes: dict[str, Node] = {}
        self._bridges: list[str] = []  # the partition's extra bridges
        self._made_ns: list[str] = []
        self._made_links: list[str] = []
        self._closed = False
        try:
            sweep()
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made_links.append(self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                self._add(name, i)
            self._write_hosts()
        except BaseException:
            self.close()
            raise

    def _add(self, name: str, i: int) -> None:
        port, peer = f"{self.id}-v{i}", f"{self.id}-p{i}"  # the peer is renamed eth0 in the namespace
        assert len(port) <= 15 and len(peer) <= 15, (port, peer)
        ns = f"{self.id}-{name}"
        _ip("netns", "add", ns)
        self._made_ns.append(ns)
        _ip("link", "add", port, "type", "veth", "peer", "name", peer)
        self._made_links.append(port)
        _ip("link", "set", peer, "netns", ns)
        _ip("-n", ns, "link", "set", peer, "name", IFNAME)
        address = f"{self.subnet}.{i + 1}"
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", IFNAME, "up")
        _ip("link", "set", port, "master", self.bridge)
        _ip("link", "set", port, "up")
        self.nodes[name] = Node(name=name, netns=ns, address=address, port=port, network=self, bridge=self.bridge)

    def _write_hosts(self) -> None:
        for node in self.nodes.values():
            lines = ["127.0.0.1 localhost", f"127.0.1.1 {node.name}"]
            lines += [f"{n.address} {n.name}" for n in self.nodes.values()]
            d = ETC_NETNS / node.netns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(lines) + "\n")
            # Names from the hosts file only: the machine's DNS server is not on this network, and a lookup
            # that waits for it fails (c10d's reverse lookup of an IPv4-mapped address warns on every start).
            (d / "nsswitch.conf").write_text(_nsswitch())

    def peer_of(self, node: Node) -> Node | None:
        """A node ``node`` should reach now: on its bridge, its link not cut (None if there is none)."""
        return next((n for n in self.nodes.values() if n is not node and n.bridge == node.bridge and not n.is_cut),
                    None)

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def partition(self, *groups: Sequence[str]) -> None:
        """Splits the network: each group's nodes keep talking among themselves, and hear nothing of the
        others (the first group stays on the main bridge, each other one gets a bridge of its own). Nodes
        named in no group stay with the first."""
        self.heal()
        for i, group in enumerate(groups[1:], start=1):
            bridge = f"{self.bridge}{i}"  # 15 characters at most: at most 9 groups
            assert len(bridge) <= 15, bridge
            _ip("link", "add", bridge, "type", "bridge")
            self._bridges.append(bridge)
            _ip("link", "set", bridge, "up")
            for name in group:
                _ip("link", "set", self.nodes[name].port, "master", bridge)
                self.nodes[name].bridge = bridge

    def heal(self) -> None:
        """Every node on the main bridge again (a partition undone; cut links stay cut)."""
        for node in self.nodes.values():
            _ip("link", "set", node.port, "master", self.bridge)
            node.bridge = self.bridge
        for bridge in self._bridges:
            _ip("link", "del", bridge, check=False)
        self._bridges.clear()

    def close(self) -> None:
        """Kills every process of every node, then removes every namespace, link and hosts file made; safe to
        call again."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for node in self.nodes.values():
            try:
                _kill_netns(node.netns, also=[p.pid for p in node.procs if p.poll() is None])
            except RuntimeError as e:
                errors.append(str(e))
        for node in self.nodes.values():
            node._reap()
        for ns in self._made_ns:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        for link in [*self._bridges, *reversed(self._made_links)]:
            _ip("link", "del", link, check=False)  # a veth's end inside a deleted namespace took its pair along
        listed = _ip("netns", "list", check=False).stdout.split()
        links = _ip("-o", "link", "show", check=False).stdout
        errors += [f"namespace {ns} is still there" for ns in self._made_ns if ns in listed]
        errors += [f"link {link} is still there" for link in [*self._bridges, *self._made_links]
                   if f" {link}:" in links or f" {link}@" in links]
        if errors:
            raise RuntimeError("; ".join(errors))
