"""Who sent the HTTP request being served: the peer's address, for per-client limits.

:class:`PeerAddress` (ASGI middleware, outermost) records the TCP peer's IP address in
:data:`PEER` for the request's task; the engine client reads it when it submits a
sequence and hands it to the engine as the request's ``client``
(``--grammar-max-compiles-per-client``). Clients behind one proxy or NAT share an address;
API keys are not per user, and OpenAI's ``user`` field is the client's own claim, so
neither identifies a client here.
"""

from __future__ import annotations

from contextvars import ContextVar

PEER: ContextVar[str | None] = ContextVar("radixserve_peer", default=None)


class PeerAddress:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        client = scope.get("client") if scope["type"] == "http" else None
        token = PEER.set(client[0] if client else None)  # a Unix socket has no peer address
        try:
            await self.app(scope, receive, send)
        finally:
            PEER.reset(token)
