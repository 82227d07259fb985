"""Request limits: refuse large bodies before reading them (413, with the limit in the message; a question's
images may add to it), text that is not Unicode (a lone surrogate from a JSON ``\\ud800`` escape: valid JSON, but
no UTF-8 encodes it), and a tenant's requests beyond its rate (429, :class:`RequestRates`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from mmrag.core.keys import UnknownTierError
from mmrag.core.keys import Tiers
from mmrag.core.settings import ApiSettings
from serving.http.errors import ApiError, error_body


# The routes a question with images comes in on (serving/api/routers/ask.py and openai.py declare them from here).
IMAGE_ROUTES = ("/v1/ask", "/v1/ask/upload")
CHAT_ROUTE = "/v1/chat/completions"
# The document upload route (serving/api/routers/documents.py): its body may be a whole file, which the route
# itself bounds by MMRAG_MAX_UPLOAD_BYTES as it streams the file to disk.
UPLOAD_ROUTES = ("/v1/documents",)


def check_tier(tier: str | None, tiers: Tiers) -> None:
    """An unknown resolution tier (a question's, an upload's, an ingest's) is refused before any work, naming
    the configured ones."""
    if tier is None:
        return
    try:
        tiers.policy(tier)
    except UnknownTierError as exc:
        raise ApiError(400, "unknown_tier", str(exc), "ask for one of the configured tiers, or leave `tier` out "
                       "for the standard one") from exc


def base64_length(nbytes: int) -> int:
    """Characters of ``nbytes`` bytes in padded base64."""
    return 4 * -(-nbytes // 3)


def question_image_bytes(settings: ApiSettings) -> int:
    """What a question's images may add to a body: its most images at their largest, in base64 (4/3 of the
    bytes; a multipart upload's part headers fit in the difference)."""
    return settings.max_question_images * base64_length(settings.documents.max_image_bytes)


@dataclass(frozen=True, slots=True)
class Allowance:
    """What a route's body may add to MMRAG_MAX_REQUEST_BYTES: ``extra`` bytes, counted once ``marker`` has
    appeared in the body (None: from the first byte), and what the 413 then says."""

    extra: int
    marker: bytes | None
    what: str
    fix: str


def body_allowances(settings: ApiSettings) -> dict[str, Allowance]:
    images = Allowance(question_image_bytes(settings), b'"images"',  # the JSON key; multipart `name="images"`
                       "the most a question with images takes: MMRAG_MAX_QUESTION_IMAGES images of "
                       "MMRAG_MAX_IMAGE_BYTES each (in base64: 4/3 of that) plus MMRAG_MAX_REQUEST_BYTES",
                       "send fewer or smaller images")
    chat = Allowance(images.extra, b'"image_url"', images.what, images.fix)  # a data-URL image part
    upload = Allowance(settings.max_upload_bytes, None,
                       "the most an upload takes: MMRAG_MAX_UPLOAD_BYTES plus MMRAG_MAX_REQUEST_BYTES",
                       "upload a smaller file")
    return {**dict.fromkeys(IMAGE_ROUTES, images), CHAT_ROUTE: chat, **dict.fromkeys(UPLOAD_ROUTES, upload)}


class BodySizeLimit:
    """413 for a body over ``max_bytes``, from its Content-Length before reading, or counted as a chunked body
    arrives. A route with an :class:`Allowance` may be longer, but only once its marker has appeared: until a
    question's `"images"` field begins the plain limit holds, so a question without images (or a huge text
    before them) is refused as early as anywhere else; an upload's allowance holds from the first byte."""

    def __init__(self, app, *, max_bytes: int, allowances: Mapping[str, Allowance] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.allowances = dict(allowances or {})

    def _too_large(self, limit: int, allowance: Allowance | None) -> ApiError:
        if allowance is None or limit == self.max_bytes:
            return ApiError(413, "request_too_large", f"request body over {limit} bytes",
                            "send a shorter request (or raise MMRAG_MAX_REQUEST_BYTES)")
        return ApiError(413, "request_too_large", f"request body over {limit} bytes, {allowance.what}", allowance.fix)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        allowance = self.allowances.get(scope["path"])
        full = self.max_bytes + (allowance.extra if allowance else 0)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > full:
            # Outside the app's exception handlers (nothing is read yet), so the response is written here.
            err = self._too_large(full, allowance)
            response = JSONResponse(error_body(err.kind, err.message, err.fix), status_code=err.status)
            return await response(scope, receive, send)
        marker = allowance.marker if allowance else None
        seen, tail, limit = 0, b"", full if allowance and marker is None else self.max_bytes

        async def counted():
            nonlocal seen, tail, limit
            message = await receive()
            chunk = message.get("body", b"")
            seen += len(chunk)
            if marker is not None and limit != full:
                if marker in tail + chunk:
                    limit = full
                tail = (tail + chunk)[-len(marker):]  # the marker may straddle two chunks
            if seen > limit:
                # Chunked bodies have no Content-Length: count as they arrive. Raised inside FastAPI's body
                # read, this ApiError (an HTTPException) reaches the app's error handlers as is.
                raise self._too_large(limit, allowance)
            return message

        await self.app(scope, counted, send)


_FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


async def reject_invalid_text(request: Request) -> None:
    """An app-wide dependency: 400 for a JSON body holding a lone surrogate anywhere (a value or a key).

    Python's JSON decoder accepts ``"\\ud800"`` (a valid pair becomes one character), so such text would
    otherwise reach the tokenizer, the file system or the response encoder and fail there as a 500.
    On a route with a body FastAPI has already parsed it, and ``request.json()`` returns that result.
    """
    if request.headers.get("content-type", "").startswith(_FORMS):
        return  # a form's fields are decoded from bytes, which yields no lone surrogate; its parser took the body
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


class RequestRates:
    """Each tenant's API requests a second (the tenants file's ``requests_per_s``; serving/api/tenants.py): a
    token bucket per tenant holding at most one second's worth (a burst of ``rate`` requests, at least one),
    refilled continuously. A request over it is refused at once with 429, before any work, and a Retry-After
    of when the next token comes. Tenants without a rate are never counted."""

    def __init__(self, rates: Mapping[str, float], clock: Callable[[], float] = time.monotonic) -> None:
        self.rates = {t: r for t, r in rates.items() if r}
        self._clock = clock
        self._tokens = {t: max(1.0, r) for t, r in self.rates.items()}
        self._at = dict.fromkeys(self.rates, self._clock())

    def take(self, tenant: str) -> None:
        rate = self.rates.get(tenant)
        if rate is None:
            return
        now = self._clock()
        burst = max(1.0, rate)
        tokens = min(burst, self._tokens[tenant] + (now - self._at[tenant]) * rate)
        self._at[tenant] = now
        if tokens < 1.0:
            self._tokens[tenant] = tokens
            wait = (1.0 - tokens) / rate
            raise ApiError(429, "rate_limited",
                           f"tenant {tenant!r} is over its {rate:g} requests a second (requests_per_s in the "
                           "tenants file)",
                           "retry after the Retry-After seconds, or spread the requests out; operators: raise it "
                           f"with `mmrag tenant quota {tenant} --requests-per-s N`",
                           headers={"Retry-After": str(max(1, math.ceil(wait)))})
        self._tokens[tenant] = tokens - 1.0
