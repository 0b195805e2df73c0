"""Listening sockets bound before anything slow loads (shared by ``serve`` and ``router``)."""

from __future__ import annotations

import errno
import socket

from radixserve.config import ConfigError


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """The listening sockets (one per address ``host`` resolves to, as uvicorn would bind),
    bound and listening before anything slow is loaded. An occupied port or an address
    this machine does not have is a ConfigError naming the flag."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"--host {host!r}: cannot resolve this address ({reason})") from None
    socks: list[socket.socket] = []
    missing: OSError | None = None
    for family, kind, proto, _, addr in dict.fromkeys((i[0], i[1], i[2], "", i[4]) for i in infos):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(2048)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRNOTAVAIL:  # e.g. "localhost" on a machine without IPv6
                missing = e
                continue
            for s in socks:
                s.close()
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"--port {port}: the address {host}:{port} is already in use") from None
            if e.errno == errno.EACCES:
                raise ConfigError(f"--port {port}: permission denied to listen on {host}:{port}") from None
            raise ConfigError(f"--host {host!r} --port {port}: cannot listen: {e.strerror or e}") from None
        socks.append(sock)
    if not socks:
        why = missing.strerror if missing is not None else "no address"
        raise ConfigError(f"--host {host!r}: this machine has no such address ({why})")
    return socks
