"""Every error is JSON with a cause and the fix, never an empty one (``FIXES`` holds the fix of each kind whose
raiser gives none). A failing dependency is 503, never a bare 500. A body the parser refuses gets a fix for its
route's kind of body (multipart/form-data or JSON).

Starlette's own errors (unknown route, wrong method, a body FastAPI cannot parse) get the same shape, and no
error body shows an absolute server path: the data dir, the ingest root and the model folder are written as
the setting that names them (``$MMRAG_DATA_DIR/features/...``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from fastapi import FastAPI, Request, params
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mmrag.adapters.qdrant import IndexConfigError
from mmrag.adapters.store import FeatureStoreError, StaleFeaturesError
from mmrag.adapters.vision_client import VisionServiceError
from mmrag.core.payload import PayloadError
from mmrag.core.settings import ServedFolders
from rag.decompose import BadQuestionError
from retrieval.search import (ImageChannelOffError, NoDocumentsError, RetrievalError, StaleIndexError,
                              UnknownDocumentError)
from serving.engine.features import MissingFeaturesError
from serving.engine.remote import EngineRequestError, EngineUnavailableError
from serving.http.schemas import ErrorDetail, ErrorResponse
from serving.pixels import PixelsInFlightError, TooManyPixelsError

log = logging.getLogger(__name__)


class ApiError(HTTPException):
    """An error with its JSON body. An HTTPException, so that one raised while FastAPI reads the body (the
    size limit counting a chunked body) reaches its handler as is, not as FastAPI's generic 400.

    Every error says what to do: a call that gives no ``fix`` gets its kind's from :data:`FIXES`. ``param``
    names the request field at fault where OpenAI's clients look for it (``error.param``)."""

    def __init__(self, status: int, kind: str, message: str, fix: str = "", *,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(status, message, headers)
        self.status, self.kind, self.message, self.fix = status, kind, message, fix or fix_for(kind)
        self.headers = headers or {}
        self.param = param

    def __str__(self) -> str:
        return self.message


def error_body(kind: str, message: str, fix: str = "", param: str | None = None) -> dict:
    # Built through the documented model, so the body and /openapi.json cannot drift apart; `param` only
    # where a field is named.
    detail = ErrorDetail(type=kind, message=message, fix=fix or fix_for(kind), param=param)
    return ErrorResponse(error=detail).model_dump(exclude_none=True)


# The fix of each error kind whose raiser gives none: the mapped exceptions below (their messages are written
# for the CLI as much as for the API, so the fix names the routes) and answers to a question's images.
FIXES: dict[str, str] = {
    "bad_question": "send a question with some text, at most the length the message names",
    "unknown_document": "`docs` takes file names or `doc_id`s that GET /v1/documents lists",
    "no_documents": "ingest documents first: POST /v1/documents (an upload), POST /v1/ingest (paths under "
                    "MMRAG_INGEST_ROOT) or `mmrag ingest PATH`",
    "image_channel_off": "leave out the image-only search, or have the operator set MMRAG_CLIP_WEIGHTS and "
                         "re-ingest",
    "missing_image_tokens": "re-ingest the page's document (POST /v1/ingest, POST /v1/documents or `mmrag "
                            "ingest`); for an image of the question, send the image again",
    "stale_index": "run `mmrag reencode` (or re-ingest, or set the encoder settings back)",
    "stale_image_tokens": "run `mmrag reencode` (or re-ingest, or set the encoder settings back)",
    "retrieval_unavailable": "retry once Qdrant answers (GET /readyz shows it)",
    "engine_unavailable": "retry once an engine replica answers (GET /readyz shows it)",
    "engine_rejected": "ask again with fewer pages or images, or a smaller `max_tokens`; the server log has "
                       "the engine's reason",
    "vision_unavailable": "retry once the vision service (MMRAG_VISION_URL) answers, or ask without images",
    "feature_store_unavailable": "retry once the feature store answers (GET /readyz shows it)",
    "index_unavailable": "the operator re-creates the collection (`mmrag index reset`) or sets "
                         "MMRAG_QDRANT_COLLECTION, as the message says",
    "index_incompatible": "the operator resets the index (`mmrag index reset`) and re-ingests, as the message says",
    "dependency_unavailable": "retry once GET /readyz says every dependency answers",
    "dependency_timeout": "retry once GET /readyz says every dependency answers",
    "unknown_conversation": "send the question's images again (a conversation keeps them "
                            "MMRAG_CONVERSATION_TTL_S seconds after its last question)",
    "image_too_large": "downscale or recompress the image (at most MMRAG_MAX_IMAGE_BYTES bytes and "
                       "MMRAG_MAX_IMAGE_PIXELS pixels)",
    "invalid_image": "send a PNG, JPEG, WebP or TIFF file's bytes",
    # The pixel errors carry a fix of their own, naming the bound; these stand in for one that does not.
    "too_many_pixels": "send fewer or smaller (downscaled) images per request (MMRAG_MAX_REQUEST_PIXELS)",
    "pixels_in_flight": "retry after the Retry-After seconds (MMRAG_MAX_PIXELS_IN_FLIGHT)",
}
DEFAULT_FIX = "see this route's errors at /docs"


def fix_for(kind: str) -> str:
    """The fix an error of ``kind`` gets when its raiser gives none."""
    return FIXES.get(kind, DEFAULT_FIX)


class ServerPaths:
    """Absolute server folders, to be written in client-facing text as the setting that names them."""

    def __init__(self, named: dict[str, Path]) -> None:
        spellings = {spelling: name for name, p in named.items() for spelling in (str(p), str(p.resolve()))}
        # Longest first: the ingest root may lie inside the data dir.
        self._spellings = sorted(((s, n) for s, n in spellings.items() if s != "/"), key=lambda sn: -len(sn[0]))

    @classmethod
    def of(cls, folders: ServedFolders) -> ServerPaths:
        named = {"$MMRAG_DATA_DIR": folders.data_dir.expanduser().absolute()}
        if folders.ingest_root is not None:
            named["$MMRAG_INGEST_ROOT"] = folders.ingest_root.expanduser().absolute()
        model = Path(folders.model).expanduser()
        if folders.model and model.is_dir():
            named["$MMRAG_MODEL"] = model.absolute()
        return cls(named)

    def hide(self, text: str) -> str:
        for spelling, name in self._spellings:
            text = text.replace(spelling, name)
        return text


def hide_paths(request: Request, text: str) -> str:
    """``text`` without the server's absolute folders (for bodies that are not errors, e.g. a job's cause)."""
    return request.app.state.server_paths.hide(text)


# (exception type, HTTP status, error type); the fix is the exception's own (``fix``) where it has one, else the
# kind's in FIXES, and one that says when to come back (``retry_after_s``) is answered with Retry-After.
_MAPPED: list[tuple[type[Exception], int, str]] = [
    # Decoded pixels (serving/pixels.py): never within the bounds (no retry helps), or not now.
    (TooManyPixelsError, 413, "too_many_pixels"),
    (PixelsInFlightError, 429, "pixels_in_flight"),
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
            return _mapped_error(exc, *mapped[cls])
    return None


def _mapped_error(exc: Exception, status: int, kind: str) -> ApiError:
    """The ApiError of a mapped domain error: its message, its own fix or its kind's, Retry-After if it says."""
    retry = getattr(exc, "retry_after_s", None)
    return ApiError(status, kind, str(exc), getattr(exc, "fix", "") or fix_for(kind),
                    headers={"Retry-After": str(retry)} if retry is not None else None)


def _http_error(request: Request, exc: HTTPException) -> ApiError:
    if exc.status_code == 400 and _takes_form(request):
        return _multipart_error(request, exc)
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


def _takes_form(request: Request) -> bool:
    """Whether the request's route reads a form (multipart/form-data) body rather than JSON."""
    body = getattr(request.scope.get("route"), "body_field", None)
    return body is not None and isinstance(body.field_info, params.Form)  # params.File is a Form


def _operation(request: Request) -> str:
    """``POST /v1/documents``: the route as /docs names it (its template, not the client's URL)."""
    route = request.scope.get("route")
    return f"{request.method} {getattr(route, 'path_format', request.url.path)}"


# What Starlette's and python-multipart's parsers say -> what to change. Their limits: 1,000 files and 1,000
# other fields per body, 4 KiB of headers per part.
_MULTIPART_FIXES = [
    ("empty boundary", "name the body's boundary in its Content-Type, not empty: `multipart/form-data; boundary=<it>`"),
    ("Maximum header size exceeded", "keep each part's headers under 4 KiB: a file name of at most 255 characters"),
    ("Too many files", "send only the parts the schema at /docs lists for this route (at most 1,000)"),
    ("Too many fields", "send only the parts the schema at /docs lists for this route (at most 1,000)"),
    ("Missing boundary", "name the body's boundary in its Content-Type: `multipart/form-data; boundary=<it>`"),
    ('"name" must be provided', 'give every part `Content-Disposition: form-data; name="<field>"`'),
]
MULTIPART_FIX = ('send multipart/form-data (RFC 7578) as `curl -F` writes it: parts separated by the non-empty '
                 'boundary its Content-Type names, each with `Content-Disposition: form-data; name="<field>"` (and '
                 '`filename="<name>"` for a file)')


def _multipart_error(request: Request, exc: HTTPException) -> ApiError:
    """A form body the parser refused: why (its own words, and the parser's below them) and a fix for a form."""
    reasons = [str(exc.detail)]
    cause = exc.__cause__ or exc.__context__
    while cause is not None and len(reasons) < 4:
        # A KeyError here is the parser's lookup of a missing parameter, which its own words already name.
        if str(cause) and str(cause) not in reasons and not isinstance(cause, (HTTPException, KeyError)):
            reasons.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    if re.search(r';\s*boundary=("")?\s*(;|$)', request.headers.get("content-type", "")):
        reasons.insert(0, "the Content-Type names an empty boundary")
    said = " ".join(reasons)
    fix = next((fix for marker, fix in _MULTIPART_FIXES if marker in said), MULTIPART_FIX)
    return ApiError(400, "bad_request", f"the multipart body of {_operation(request)} cannot be read: "
                    f"{'; '.join(r.rstrip('.') for r in reasons)}", fix)


def _validation_error(request: Request, exc: RequestValidationError) -> ApiError:
    """A body or parameter that does not match the schema: the first error, said for this API's clients."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = tuple(str(p) for p in first.get("loc", ()))
    where, msg = ".".join(loc), first.get("msg", "invalid")
    if first.get("type") == "finite_number":  # Python's JSON reads NaN and Infinity; JSON itself has neither
        return ApiError(422, "invalid_request", f"{where}: must be a finite number (NaN and Infinity are not JSON)",
                        "send a finite JSON number, or leave the field out")
    if "Expected UploadFile" in msg:  # FastAPI read the part as text: it named no file
        field = loc[1] if len(loc) > 1 else "file"
        return ApiError(422, "invalid_request", f"{where}: the part is a text field, not a file: its "
                        "Content-Disposition has no `filename=` (or an empty one, or only RFC 5987's `filename*=`, "
                        "which is not read)", f'send it as a file part with a plain name: `Content-Disposition: '
                        f'form-data; name="{field}"; filename="<name>"` (`curl -F {field}=@<file>` writes it)')
    if _takes_form(request):
        fix = f"send multipart/form-data with the fields the schema of {_operation(request)} at /docs lists"
    elif loc[:1] == ("body",) and not _says_json(request):  # FastAPI reads a JSON body only when it is said to be
        return ApiError(422, "invalid_request", f"{_operation(request)} takes a JSON body, and this one was "
                        f"sent as {request.headers.get('content-type') or 'no Content-Type'}",
                        "send the header Content-Type: application/json with the body (curl: -H 'Content-Type: "
                        "application/json'; curl -d alone says application/x-www-form-urlencoded)")
    else:
        fix = f"see the schema of {_operation(request)} at /docs"
    return ApiError(422, "invalid_request", f"{where}: {msg}", fix)


def _says_json(request: Request) -> bool:
    """The request's Content-Type is JSON (application/json, or a +json type), as FastAPI's body reader asks."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def install(app: FastAPI, paths: ServerPaths) -> None:
    app.state.server_paths = paths

    def respond(exc: ApiError) -> JSONResponse:
        body = error_body(exc.kind, paths.hide(exc.message), paths.hide(exc.fix), exc.param)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return respond(_http_error(request, exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(_validation_error(request, exc))

    def mapped(status: int, kind: str):
        async def handle(_: Request, exc: Exception) -> JSONResponse:
            return respond(_mapped_error(exc, status, kind))

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
