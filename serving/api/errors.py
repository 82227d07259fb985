"""Every error is JSON with a cause and the fix. A failing dependency is 503, never a bare 500.

Starlette's own errors (unknown route, wrong method, a body FastAPI cannot parse) get the same shape, and no
error body shows an absolute server path: the data dir, the ingest root and the model folder are written as
the setting that names them (``$MMRAG_DATA_DIR/features/...``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from adapters.qdrant import IndexConfigError
from adapters.store import FeatureStoreError, StaleFeaturesError
from adapters.vision_client import VisionServiceError
from core.payload import PayloadError
from core.settings import Settings
from rag.decompose import BadQuestionError
from retrieval.search import (ImageChannelOffError, NoDocumentsError, RetrievalError, StaleIndexError,
                              UnknownDocumentError)
from serving.api.schemas import ErrorDetail, ErrorResponse
from serving.engine.features import MissingFeaturesError
from serving.engine.remote import EngineRequestError, EngineUnavailableError

log = logging.getLogger(__name__)


class ApiError(HTTPException):
    """An error with its JSON body. An HTTPException, so that one raised while FastAPI reads the body (the
    size limit counting a chunked body) reaches its handler as is, not as FastAPI's generic 400."""

    def __init__(self, status: int, kind: str, message: str, fix: str = "", *,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.status, self.kind, self.message, self.fix = status, kind, message, fix
        self.headers = headers or {}

    def __str__(self) -> str:
        return self.message


def error_body(kind: str, message: str, fix: str = "") -> dict:
    # Built through the documented model, so the body and /openapi.json cannot drift apart.
    return ErrorResponse(error=ErrorDetail(type=kind, message=message, fix=fix)).model_dump()


class ServerPaths:
    """Absolute server folders, to be written in client-facing text as the setting that names them."""

    def __init__(self, named: dict[str, Path]) -> None:
        spellings = {spelling: name for name, p in named.items() for spelling in (str(p), str(p.resolve()))}
        # Longest first: the ingest root may lie inside the data dir.
        self._spellings = sorted(((s, n) for s, n in spellings.items() if s != "/"), key=lambda sn: -len(sn[0]))

    @classmethod
    def of(cls, settings: Settings) -> ServerPaths:
        named = {"$MMRAG_DATA_DIR": settings.data_dir.expanduser().absolute()}
        if settings.ingest_root is not None:
            named["$MMRAG_INGEST_ROOT"] = settings.ingest_root.expanduser().absolute()
        model = Path(settings.model).expanduser()
        if settings.model and model.is_dir():
            named["$MMRAG_MODEL"] = model.absolute()
        return cls(named)

    def hide(self, text: str) -> str:
        for spelling, name in self._spellings:
            text = text.replace(spelling, name)
        return text


def hide_paths(request: Request, text: str) -> str:
    """``text`` without the server's absolute folders (for bodies that are not errors, e.g. a job's cause)."""
    return request.app.state.server_paths.hide(text)


# (exception type, HTTP status, error type); the exception's message already says what to do.
_MAPPED: list[tuple[type[Exception], int, str]] = [
    (BadQuestionError, 400, "bad_question"),
    (UnknownDocumentError, 404, "unknown_document"),
    (NoDocumentsError, 404, "no_documents"),
    (ImageChannelOffError, 400, "image_channel_off"),
    (MissingFeaturesError, 409, "missing_image_tokens"),
    # Pages of another encoder (a model, salt or pixel-bound change): never served; the message names the fix.
    (StaleIndexError, 409, "stale_index"),
    (StaleFeaturesError, 409, "stale_image_tokens"),
    (RetrievalError, 503, "retrieval_unavailable"),
    (EngineUnavailableError, 503, "engine_unavailable"),
    (EngineRequestError, 502, "engine_rejected"),
    (VisionServiceError, 503, "vision_unavailable"),  # a FeatureStoreError: listed first so it is named
    (FeatureStoreError, 503, "feature_store_unavailable"),
    (IndexConfigError, 503, "index_unavailable"),
    (PayloadError, 503, "index_incompatible"),  # points written by another mmrag version; says to reset
    (ConnectionError, 503, "dependency_unavailable"),
    (TimeoutError, 503, "dependency_timeout"),
]

# Starlette's own HTTP errors, by status: (error type, fix).
_HTTP_KINDS: dict[int, tuple[str, str]] = {
    400: ("bad_request", "send a JSON body as the schema at /docs describes"),
    404: ("not_found", "see the routes at /docs"),
    405: ("method_not_allowed", "use a method the `Allow` header lists (see /docs)"),
}


def api_error_of(exc: Exception) -> ApiError | None:
    """The ApiError an exception is answered with (itself, or by its class's entry in the mapping, the most
    specific class first, as the app's handlers pick it); None for one no handler maps. A streamed answer that
    fails after its status line uses it for its last event, so the error reads as it would as JSON."""
    if isinstance(exc, ApiError):
        return exc
    mapped = {exc_type: (status, kind) for exc_type, status, kind in _MAPPED}
    for cls in type(exc).__mro__:
        if cls in mapped:
            status, kind = mapped[cls]
            return ApiError(status, kind, str(exc))
    return None


def _http_error(request: Request, exc: HTTPException) -> ApiError:
    # FastAPI reports any failure to decode a JSON body as a 400 "error parsing the body", the cause chained.
    if isinstance(exc.__cause__, RecursionError):
        return ApiError(400, "invalid_json", "the JSON body is nested too deeply to parse",
                        "send the flat objects the schema at /docs describes")
    if isinstance(exc.__cause__, UnicodeDecodeError):
        return ApiError(400, "invalid_text", f"the body is not UTF-8 text ({exc.__cause__.reason} at byte "
                        f"{exc.__cause__.start})", "send JSON encoded as UTF-8")
    kind, fix = _HTTP_KINDS.get(exc.status_code, ("http_error", "see the API at /docs"))
    return ApiError(exc.status_code, kind, f"{exc.detail}: {request.method} {request.url.path}", fix,
                    headers=dict(exc.headers or {}))


def install(app: FastAPI, paths: ServerPaths) -> None:
    app.state.server_paths = paths

    def respond(exc: ApiError) -> JSONResponse:
        body = error_body(exc.kind, paths.hide(exc.message), paths.hide(exc.fix))
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return respond(_http_error(request, exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return respond(ApiError(422, "invalid_request", f"{where}: {first.get('msg', 'invalid')}",
                                "see the schema at /docs"))

    def mapped(status: int, kind: str):
        async def handle(_: Request, exc: Exception) -> JSONResponse:
            return respond(ApiError(status, kind, str(exc)))

        return handle

    for exc_type, status, kind in _MAPPED:
        app.add_exception_handler(exc_type, mapped(status, kind))

    def unexpected(exc: Exception) -> JSONResponse:
        return respond(ApiError(500, "internal", f"{type(exc).__name__}: {exc}",
                                "this is a bug in mmrag: please report it"))

    app.add_middleware(AnswerUnexpected, respond=unexpected)


class AnswerUnexpected:
    """A 500 in the error shape for any exception no handler maps, and the keep-alive connection kept.

    Not an ``Exception`` handler: Starlette's ServerErrorMiddleware, where those run, re-raises after
    answering, and uvicorn then closes the client's connection. This answers and returns instead.
    """

    def __init__(self, app, *, respond) -> None:
        self.app = app
        self.respond = respond

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:  # a bug: logged with its traceback, answered as a 500
            log.exception("unhandled error")
            if started:
                raise  # half a response is out: only closing the connection ends it
            await self.respond(exc)(scope, receive, send)
