"""The network interface a node's ranks give gloo: the one this node reaches the store over.

Left to itself, gloo binds the address its host's name resolves to, or
loopback when that address cannot be bound here, and offers it to its peers.
On many hosts the name resolves to loopback (Debian writes ``127.0.1.1
HOSTNAME`` in ``/etc/hosts``) or to an address of another network namespace:
every rank then offers its peers a loopback address, no group across nodes
ever forms, and each generation's build times out again and again. Unless
the user set ``GLOO_SOCKET_IFNAME``, the agent names the interface that
carries this node's route to the store (``--master-addr``): every node of
the job reaches node 0 over that network, and node 0 serves the store on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket
import sys

__all__ = ["GLOO_SOCKET_IFNAME", "gloo_interface", "interface_of", "source_address"]

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def gloo_interface(master_addr: str) -> str | None:
    """The interface for gloo on this node: ``lo`` for a loopback store, else the one holding the address this
    node reaches ``master_addr`` from; None when that cannot be told (gloo then chooses, as before)."""
    if master_addr in _LOOPBACK:
        return "lo"
    local = source_address(master_addr)
    return interface_of(local) if local is not None else None


def source_address(host: str) -> str | None:
    """The local address this node's traffic to ``host`` leaves from (a route lookup: a datagram socket's
    connect sends nothing), or None when ``host`` does not resolve or has no route."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0]).split("%", 1)[0]
        except OSError:
            continue
    return None


class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]  # room for a sockaddr_in6


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("next", ctypes.POINTER(_Ifaddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.POINTER(_Sockaddr)), ("netmask", ctypes.POINTER(_Sockaddr)),
                     ("ifu", ctypes.c_void_p), ("data", ctypes.c_void_p)]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` (IPv4 or IPv6), from getifaddrs(3), as gloo reads
    interfaces; None when none does, or off Linux (the layout of struct sockaddr is Linux's)."""
    if not sys.platform.startswith("linux"):
        return None
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        wanted = socket.inet_pton(family, address)
    except OSError:
        return None
    # The address starts after the port (2 bytes) in a sockaddr_in, after the port and the flow label (6) in
    # a sockaddr_in6.
    start, size = (2, 4) if family == socket.AF_INET else (6, 16)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return None
    try:
        node = head
        while node:
            entry = node.contents
            if entry.addr and entry.addr.contents.family == family:
                if bytes(entry.addr.contents.data[start:start + size]) == wanted:
                    return entry.name.decode()
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return None
