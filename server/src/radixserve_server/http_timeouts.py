"""Read timeouts for uvicorn's HTTP/1.1 connections (``--http-header-timeout``,
``--http-body-timeout``).

uvicorn closes a kept-alive connection that stays idle (``--timeout-keep-alive``) but waits
forever for the rest of a request that has started: a client that sends half its headers, or
its headers and half the body its Content-Length announced, holds the connection (and a slot
of ``--max-connections``) as long as it likes. :func:`timed_protocol` gives uvicorn a protocol
that closes such a connection: the headers must all arrive within the header timeout of the
connection opening (or of the previous response on it), the body within the body timeout of
the headers. A deadline, not an idle timer, so a byte now and then does not extend it. A
handler still reading a closed connection's body sees the client gone (499, nothing sent).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("radixserve.server")

HEADERS, BODY = "headers", "body"  # what a connection is waiting for; None: nothing (handled or answered)


def timed_protocol(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the two deadlines (0: none)."""
    limits = {HEADERS: (header_timeout, "--http-header-timeout"), BODY: (body_timeout, "--http-body-timeout")}

    class TimedH11Protocol(H11Protocol):
        _phase: str | None = None
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._follow()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def _follow(self) -> None:
            """Arm the deadline of what the connection now waits for, when that changed."""
            cycle = self.cycle
            phase = HEADERS if cycle is None or cycle.response_complete else BODY if cycle.more_body else None
            if phase == self._phase or self.transport.is_closing():
                return
            self._disarm()
            self._phase = phase
            if phase is not None and limits[phase][0] > 0:
                self._deadline = self.loop.call_later(limits[phase][0], self._expire, phase)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self, phase: str) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            timeout, flag = limits[phase]
            where = f"{self.client[0]}:{self.client[1]} " if self.client else ""
            logger.info("closed the connection of %sthe request %s did not arrive within %g s (%s)",
                        where, phase, timeout, flag)
            self.transport.close()

    return TimedH11Protocol
