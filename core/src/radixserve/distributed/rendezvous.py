"""Where a replica's ranks meet: a ``torch.distributed`` TCPStore that rank 0 serves on the
address of ``--dist-init-addr`` only (loopback by default), and gloo's sockets on the same
interface.

torch's own ``tcp://`` rendezvous listens on every interface whatever host it is given, so
rank 0 binds the listening socket itself and hands it to the store (``master_listen_fd``).
Gloo's connections between ranks go over the interface named by ``GLOO_SOCKET_IFNAME`` (and
NCCL's bootstrap over ``NCCL_SOCKET_IFNAME``); when they are unset they are pinned to the
interface that holds the rendezvous address, so a loopback replica opens no socket that
another host can reach. An operator's own setting of those variables is left alone.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import struct
from urllib.parse import urlsplit

import torch.distributed as dist

logger = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def split_init_method(init_method: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT); IPv6 hosts in brackets."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"expected a tcp://HOST:PORT rendezvous address, got {init_method!r}")
    return parts.hostname, parts.port


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` only, listening."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def make_store(init_method: str, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The replica's TCPStore: rank 0 serves it on the rendezvous address only, the others
    connect to it."""
    host, port = split_init_method(init_method)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    sock = listen_socket(host, port)
    try:
        store = dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def interface_of(host: str) -> str | None:
    """The name of the local network interface that holds ``host``'s (IPv4) address; any
    loopback interface for a loopback address; None when none does (or off Linux)."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
        import fcntl
    except (OSError, ValueError, ImportError):
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                continue
        local = ipaddress.ip_address(packed[20:24])
        if local == ip or (ip.is_loopback and local.is_loopback):
            return name
    return None


def pin_interfaces(host: str) -> None:
    """Point gloo's and NCCL's sockets at the interface of ``host`` unless set already."""
    if _is_ip(host) and ipaddress.ip_address(host).is_unspecified:
        return  # 0.0.0.0: the operator asked for every interface
    name = interface_of(host)
    if name is None:  # another node's address (a follower node), or not IPv4
        logger.info("rendezvous %s: no local interface holds this address; gloo picks its own "
                    "(GLOO_SOCKET_IFNAME chooses)", host)
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, name)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
