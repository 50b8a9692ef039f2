"""Keeps the Mooncake Transfer Engine's listening sockets on ``[cluster] host``: the KV data plane stays on the network.

Invariant: every TCP socket that a Mooncake call made inside ``confined(host)`` listens on is bound to the
address of ``host``, never to a wildcard; otherwise the call raises ``ExposedListenerError``. The engine has
no authentication: whoever reaches its handshake (RPC) port and its TCP data port can read and overwrite the
registered KV pool, so those ports must exist on the cluster's address only.

Why Mooncake needs help. ``TransferEngine.initialize(local_hostname, "P2PHANDSHAKE", ...)`` uses
``local_hostname`` only as the address it advertises. mooncake-transfer-engine 0.3.13 binds the handshake
listener with ``findAvailableTcpPort`` (``INADDR_ANY``, or ``in6addr_any`` with ``MC_USE_IPV6``;
transfer_metadata_plugin.cpp, whose ``SocketHandShakePlugin::startDaemon`` listens on that socket) and the
TCP transport's data acceptor on ``asio::ip::tcp::v6()`` any, dual-stack (tcp_transport_session_impl.h,
``TcpContext``). No setting changes either: ``MC_TCP_BIND_ADDRESS`` only picks the advertised address
outside P2P handshake mode (transfer_engine_impl.cpp), ``MC_LEGACY_RPC_PORT_BINDING``, ``MC_USE_TENT`` and
``MC_RDMA_BIND_ADDRESS`` leave both binds as they are.

How. ``_bind_guard`` (C, services/worker/kv/_bind_guard.c) points the ``bind`` imports of Mooncake's own shared
objects (their GOT slots) at a wrapper that rewrites a wildcard address to the configured one, an IPv4
address on an IPv6 socket becoming ``::ffff:a.b.c.d``. In-process, without LD_PRELOAD or a re-exec: nothing
outside Mooncake's objects (Python's sockets, gRPC, ZMQ) is touched and no child process inherits anything.
It patches the objects loaded when ``confined`` is entered, which is why it is entered after the import that
loads them (``mooncake.engine``, ``mooncake.store``) and right before the call that binds. Then the check:
the process's listening sockets that the call opened (``/proc/self/fd`` against ``/proc/self/net/tcp{,6}``)
must all be on the address, so a wheel that binds some other way fails closed instead of serving on every
interface. A wildcard ``host`` (``0.0.0.0``, ``::``) asks for every interface: nothing is confined.

One address per process: the wrapper stays in place after ``confined`` returns (a Mooncake object binding
later is confined too), and confining to a second address raises ``ValueError``.
"""

from __future__ import annotations

import glob
import ipaddress
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from services.worker.kv import _bind_guard

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


class ExposedListenerError(RuntimeError):
    """A Mooncake call left a socket listening on an address other than the configured one."""


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket of this process (an IPv4-mapped IPv6 address given as the IPv4 one)."""

    address: Address
    port: int


def resolve(host: str) -> Address:
    """The address a host binds: an IP literal itself, a name's first IPv4 address (else its first IPv6 one)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    if not addresses:
        raise OSError(f"{host!r} resolves to no address")
    return next((a for a in addresses if a.version == 4), addresses[0])


def mooncake_paths() -> tuple[str, ...]:
    """Directories of Mooncake's shared objects: the package's and its wheel's vendored ``*.libs``."""
    import mooncake  # here: importing this module loads nothing of Mooncake's

    paths: list[str] = []
    for package in mooncake.__path__:
        real = os.path.realpath(package)
        paths.append(real + "/")
        vendored = glob.glob(os.path.join(os.path.dirname(real), "mooncake*.libs"))  # auditwheel's copies
        paths.extend(os.path.realpath(libs) + "/" for libs in vendored)
    return tuple(dict.fromkeys(paths))


def install(address: Address) -> int:
    """Rewrite the wildcard binds of the Mooncake objects loaded now to ``address``; return the hooked slots."""
    if address.version == 6 and not os.environ.get("MC_USE_IPV6"):
        raise ValueError(f"an IPv6 host ({address}) needs MC_USE_IPV6=1: Mooncake binds IPv4 sockets without it")
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    hooked: int = _bind_guard.install(family, address.packed, mooncake_paths())
    if hooked == 0:
        raise ExposedListenerError(f"no bind import found in Mooncake's shared objects under {mooncake_paths()}")
    return hooked


def rewrites() -> int:
    """Wildcard binds of Mooncake's objects rewritten so far in this process."""
    count: int = _bind_guard.rewrites()
    return count


def _socket_inodes(pid: int | str) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _parse_address(field: str) -> tuple[Address, int]:
    hex_address, hex_port = field.split(":")
    words = [int(hex_address[i : i + 8], 16) for i in range(0, len(hex_address), 8)]
    packed = struct.pack(f"={len(words)}I", *words)  # the kernel prints each 32-bit word in host order
    address: Address = ipaddress.ip_address(packed)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(hex_port, 16)


def listeners(pid: int | str = "self") -> dict[int, Listener]:
    """The listening TCP sockets of a process (this one by default), by socket inode."""
    own = _socket_inodes(pid)
    found = {}
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            with open(table) as lines:
                rows = [line.split() for line in lines.readlines()[1:]]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for row in rows:
            inode = int(row[9])
            if row[3] == _LISTEN and inode in own:
                found[inode] = Listener(*_parse_address(row[1]))
    return found


@contextmanager
def confined(host: str) -> Iterator[Address]:
    """Run a Mooncake call that binds (``initialize``, a store client's ``setup``) with its listeners on ``host``.

    Raises ``ExposedListenerError`` when the call left a listener on another address.
    """
    address = resolve(host)
    if address.is_unspecified:
        yield address
        return
    install(address)
    before = set(listeners())
    yield address
    exposed = [f"{listener.address}:{listener.port}" for inode, listener in listeners().items()
               if inode not in before and listener.address != address]  # fmt: skip
    if exposed:
        raise ExposedListenerError(
            f"Mooncake listens on {', '.join(exposed)}, not only on {address} ({host}): refusing to serve the KV "
            "pool beyond the cluster's address"
        )
