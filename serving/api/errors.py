"""Every error is JSON with a cause and the fix. A failing dependency is 503, never a bare 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from adapters.qdrant import IndexConfigError
from adapters.store import FeatureStoreError
from core.payload import PayloadError
from rag.decompose import BadQuestionError
from retrieval.search import ImageChannelOffError, NoDocumentsError, RetrievalError, UnknownDocumentError
from serving.api.schemas import ErrorDetail, ErrorResponse
from serving.engine.features import MissingFeaturesError
from serving.engine.remote import EngineRequestError, EngineUnavailableError

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.fix = status, kind, message, fix


def error_body(kind: str, message: str, fix: str = "") -> dict:
    # Built through the documented model, so the body and /openapi.json cannot drift apart.
    return ErrorResponse(error=ErrorDetail(type=kind, message=message, fix=fix)).model_dump()


# (exception type, HTTP status, error type); the exception's message already says what to do.
_MAPPED: list[tuple[type[Exception], int, str]] = [
    (BadQuestionError, 400, "bad_question"),
    (UnknownDocumentError, 404, "unknown_document"),
    (NoDocumentsError, 404, "no_documents"),
    (ImageChannelOffError, 400, "image_channel_off"),
    (MissingFeaturesError, 409, "missing_image_tokens"),
    (RetrievalError, 503, "retrieval_unavailable"),
    (EngineUnavailableError, 503, "engine_unavailable"),
    (EngineRequestError, 502, "engine_rejected"),
    (FeatureStoreError, 503, "feature_store_unavailable"),
    (IndexConfigError, 503, "index_unavailable"),
    (PayloadError, 503, "index_incompatible"),  # points written by another mmrag version; says to reset
    (ConnectionError, 503, "dependency_unavailable"),
    (TimeoutError, 503, "dependency_timeout"),
]


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.kind, exc.message, exc.fix), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse(
            error_body("invalid_request", f"{where}: {first.get('msg', 'invalid')}", "see the schema at /docs"),
            status_code=422,
        )

    for exc_type, status, kind in _MAPPED:
        app.add_exception_handler(exc_type, _handler(status, kind))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(
            error_body("internal", f"{type(exc).__name__}: {exc}", "this is a bug in mmrag: please report it"),
            status_code=500,
        )


def _handler(status: int, kind: str):
    async def handle(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(kind, str(exc)), status_code=status)

    return handle
