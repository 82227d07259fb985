"""Slow clients: a connection that sends its request headers, or its body, slower than a bound is closed, so
thousands of half-sent requests cannot hold the server's sockets and memory (issue 41, item 8).

- **Headers** (:func:`header_timeout_protocol`): uvicorn's h11 protocol with a timer from the moment the
  connection opens, and again once each response is sent, until the next request's headers are complete; at
  the bound the connection is closed (uvicorn bounds only the idle time between requests, not a request whose
  headers trickle in; the ASGI app never sees a request before its headers are whole).
- **Body** (:class:`BodyReadTimeout`): each chunk of a body must come within ``seconds`` of the one before (an
  idle bound, so a large upload on a slow but steady link is not cut); past it, 408 and the connection closed.
  Once the body is whole, waiting for the client's disconnect (what an answer in flight watches) is not bounded.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.http.errors import ApiError


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's ``http=`` protocol class closing a connection whose request headers take over ``seconds``."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request's headers are whole: its body has its own bound
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers took over %.0f s", seconds)
                self.transport.close()

    return HeaderTimeoutProtocol


class BodyReadTimeout:
    """ASGI middleware: 408 when a body's next chunk takes over ``seconds`` (raised inside the app's body read,
    so the app's error handlers write it; ``Connection: close`` ends the connection)."""

    def __init__(self, app, *, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        whole = False

        async def bounded():
            nonlocal whole
            if whole:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.seconds)
            except TimeoutError:
                raise ApiError(408, "request_timeout", f"the request body's next bytes took over {self.seconds:g} s",
                               "send the body without pauses (or raise MMRAG_HTTP_BODY_TIMEOUT_S)",
                               headers={"Connection": "close"}) from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, bounded, send)
