"""Request limits: refuse large bodies before reading them (413, with the limit in the message), and text that
is not Unicode (a lone surrogate from a JSON ``\\ud800`` escape: valid JSON, but no UTF-8 encodes it)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from serving.api.errors import ApiError, error_body


class BodySizeLimit:
    def __init__(self, app, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> ApiError:
        return ApiError(413, "request_too_large", f"request body over {self.max_bytes} bytes",
                        "send a shorter request (or raise MMRAG_MAX_REQUEST_BYTES)")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            # Outside the app's exception handlers (nothing is read yet), so the response is written here.
            err = self._too_large()
            response = JSONResponse(error_body(err.kind, err.message, err.fix), status_code=err.status)
            return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                # Chunked bodies have no Content-Length: count as they arrive. Raised inside FastAPI's body
                # read, this ApiError (an HTTPException) reaches the app's error handlers as is.
                raise self._too_large()
            return message

        await self.app(scope, counted, send)


async def reject_invalid_text(request: Request) -> None:
    """An app-wide dependency: 400 for a JSON body holding a lone surrogate anywhere (a value or a key).

    Python's JSON decoder accepts ``"\\ud800"`` (a valid pair becomes one character), so such text would
    otherwise reach the tokenizer, the file system or the response encoder and fail there as a 500.
    On a route with a body FastAPI has already parsed it, and ``request.json()`` returns that result.
    """
    if not await request.body():
        return
    try:
        body = await request.json()
    except ValueError:
        return  # not JSON: the route's own body validation answers
    where = _lone_surrogate_at(body)
    if where is not None:
        raise ApiError(400, "invalid_text", f"{where}: the text holds a lone UTF-16 surrogate (a \\ud800-\\udfff "
                       "escape without its pair), which is not Unicode text",
                       "send UTF-8 text; a JSON \\uD800-\\uDFFF escape must be one half of a surrogate pair")


def _lone_surrogate_at(value: Any) -> str | None:
    """Where in a decoded JSON document a string (value or key) holds a lone surrogate, e.g. ``body.paths.0``."""
    stack: list[tuple[str, Any]] = [("body", value)]  # iterative: a deep document must not exhaust the stack
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if not _is_unicode(key):
                    return where
                stack.append((f"{where}.{key}", child))
        elif isinstance(item, list):
            stack.extend((f"{where}.{i}", child) for i, child in enumerate(item))
        elif isinstance(item, str) and not _is_unicode(item):
            return where
    return None


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
