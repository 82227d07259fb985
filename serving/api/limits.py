"""Request size limit: refuse large bodies before reading them (413, JSON, with the limit in the message)."""

from __future__ import annotations

import json


class BodySizeLimit:
    def __init__(self, app, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            return await self._reject(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # chunked bodies have no Content-Length: count as they arrive
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send) -> None:
        body = json.dumps({"error": {"type": "request_too_large",
                                     "message": f"request body over {self.max_bytes} bytes",
                                     "fix": "send a shorter request (or raise MMRAG_MAX_REQUEST_BYTES)"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
