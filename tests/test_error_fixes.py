"""Every error says what to do about it: each error kind the API can answer with is enumerated (from errors.py's
mapping and every `ApiError(...)` in the source), each one cheap to reach is triggered on the session's real
server and must carry a non-empty fix that fits its route (a multipart route's fix speaks of multipart, a chat
field's names the field), and the source is checked for `ApiError(...)` calls without a fix of their own.
"""

from __future__ import annotations

import ast
import base64
import functools
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from PIL import Image

from serving.http import errors
from tests.conftest import API_KEY

REPO = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
RETRY = "What is the retry limit of the ingest service?"
CHAT = {"model": "mmrag", "messages": [{"role": "user", "content": RETRY}]}

# `ApiError(...)` calls that rely on their kind's fix in errors.FIXES instead of passing their own. They are in
# serving/api/answering.py, whose owner is to pass route-specific fixes there (issue 24); the list may only shrink.
RELY_ON_DEFAULT_FIX: set[tuple[str, str]] = set()  # (file, kind) of an ApiError call that passes no fix

# Kinds not triggered here, and why: each needs a broken dependency or a special index, which other tests set up
# (named where they do); their fixes are still checked statically below.
NOT_TRIGGERED = {
    "unknown_figure": "a page with known figures, whose id only a listing gives (test_figure_citations.py)",
    "no_documents": "an empty collection (test_tenants.py)",
    "image_channel_off": "an image-only search, which no route asks for",
    "missing_image_tokens": "a page whose feature entry is gone",
    "image_expired": "a question image whose tokens were deleted since it was sent",
    "stale_index": "an index of another encoder (test_upgrade.py)",
    "stale_image_tokens": "tokens of another encoder",
    "retrieval_unavailable": "Qdrant down",
    "engine_unavailable": "a dead engine (test_api.py)",
    "engine_rejected": "a replica that refuses a prompt (test_remote_engine.py)",
    "vision_unavailable": "a vision service down (test_vision_service.py)",
    "feature_store_unavailable": "Redis down (test_faults_store.py)",
    "index_unavailable": "a collection of other vector sizes",
    "index_incompatible": "points of another mmrag version",
    "dependency_unavailable": "a dependency that refuses connections",
    "dependency_timeout": "a dependency that does not answer",
    "overloaded": "MMRAG_MAX_QUESTIONS_IN_FLIGHT questions at once (test_load.py)",
    "internal": "a bug (test_hostile.py raises one on purpose)",
    "answer_failed": "an unmapped failure after a stream began",
    "http_error": "a Starlette HTTP error of a status no route answers with",
    "source_gone": "a deleted source file (test_hostile.py)",
    "vision_queue_full": "the vision service's queue full (test_vision_service.py)",
    "too_many_pixels": "images of more pixels than a request may decode (serving/pixels.py, tested with it)",
    "pixels_in_flight": "the pixel budget spent by other requests (serving/pixels.py, tested with it)",
    "rate_limited": "a tenant over its requests_per_s (test_tenant_quotas.py)",
    "quota_exceeded": "a tenant over its documents or bytes quota (test_tenant_quotas.py)",
    "request_timeout": "a body sent slower than MMRAG_HTTP_BODY_TIMEOUT_S (test_tenant_quotas.py)",
}


# --- the kinds, from the source ----------------------------------------------------------------------------


@dataclass
class Call:
    where: str  # path:line
    kind: str | None  # None: not a literal (errors.py passes its mapped kinds on)
    fix: ast.expr | None


def _arg(node: ast.Call, index: int, name: str) -> ast.expr | None:
    if len(node.args) > index:
        return node.args[index]
    return next((k.value for k in node.keywords if k.arg == name), None)


@functools.cache
def api_error_calls() -> tuple[Call, ...]:
    calls = []
    for folder in ("serving", "mmrag", "rag", "retrieval", "ingestion"):  # mmrag: its adapters and bench too
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == \
                        "ApiError":
                    kind = _arg(node, 1, "kind")
                    calls.append(Call(f"{path.relative_to(REPO)}:{node.lineno}",
                                      kind.value if isinstance(kind, ast.Constant) else None, _arg(node, 3, "fix")))
    return tuple(calls)


def _gives_a_fix(fix: ast.expr | None) -> bool:
    return fix is not None and not (isinstance(fix, ast.Constant) and not fix.value)


def every_kind() -> set[str]:
    literal = {c.kind for c in api_error_calls() if c.kind}
    mapped = {kind for _, _, kind in errors._MAPPED}
    http = {kind for kind, _ in errors._HTTP_KINDS.values()} | {"http_error"}
    return literal | mapped | http | {"invalid_request"}


def test_every_api_error_call_passes_a_fix_of_its_own():
    without = {(c.where.split(":")[0], c.kind): c.where for c in api_error_calls() if not _gives_a_fix(c.fix)}
    assert set(without) <= RELY_ON_DEFAULT_FIX, sorted(set(without) - RELY_ON_DEFAULT_FIX)
    assert all(kind in errors.FIXES for _, kind in RELY_ON_DEFAULT_FIX)
    assert all(c.kind for c in api_error_calls() if "errors.py" not in c.where), "a kind that is not a literal"


def test_every_mapped_exception_has_a_fix_and_no_fix_is_empty():
    assert {kind for _, _, kind in errors._MAPPED} <= set(errors.FIXES)
    assert all(fix.strip() for fix in errors.FIXES.values()) and errors.DEFAULT_FIX
    assert errors.ApiError(400, "bad_question", "x").fix == errors.FIXES["bad_question"]
    assert errors.error_body("made_up", "x")["error"]["fix"] == errors.DEFAULT_FIX  # never empty, whatever calls it


# --- each kind cheap to reach, on the real server -------------------------------------------------------------


def multipart(*parts: bytes, boundary: str = "b0undary", content_type: str | None = None, **headers) -> dict:
    """A raw multipart/form-data body (what a hostile or a broken client sends), as httpx request arguments."""
    body = b"".join(b"--%s\r\n%s\r\n" % (boundary.encode(), p) for p in parts) + b"--%s--\r\n" % boundary.encode()
    return {"content": body, "headers": {
        **headers, "content-type": content_type or f"multipart/form-data; boundary={boundary}"}}


def part(disposition: str, data: bytes = b"x") -> bytes:
    return f"Content-Disposition: form-data; {disposition}\r\n\r\n".encode() + data


QUESTION_PART = part('name="question"', RETRY.encode())


def png(size: tuple[int, int] = (8, 8), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class Case:
    kind: str
    method: str
    url: str
    request: dict = field(default_factory=dict)  # httpx request arguments
    fits: str = ""  # what the fix says on this route
    status: int = 400
    param: str | None = None
    headers: dict = field(default_factory=lambda: dict(AUTH))


def chat(**fields) -> dict:
    return {"json": {**CHAT, **fields}}


CASES = [
    Case("bad_question", "POST", "/v1/ask", {"json": {"question": "   "}}, "question"),
    Case("bad_question", "POST", "/v1/chat/completions", {"json": {**CHAT, "messages": [
        {"role": "user", "content": ""}]}}, "question"),
    Case("unknown_document", "POST", "/v1/ask", {"json": {"question": RETRY, "docs": ["no_such.pdf"]}},
         "GET /v1/documents", 404),
    Case("unknown_document", "DELETE", "/v1/documents/no-such-doc", {}, "GET /v1/documents", 404),
    Case("unknown_conversation", "POST", "/v1/ask", {"json": {"question": RETRY, "conversation_id": "gone"}},
         "images again", 404),
    Case("invalid_image", "POST", "/v1/ask", {"json": {"question": RETRY, "images": [{"data": ""}]}}, "PNG"),
    Case("invalid_image", "POST", "/v1/ask/upload", multipart(QUESTION_PART, part(
        'name="images"; filename="empty.png"', b"")), "PNG"),
    Case("invalid_image", "POST", "/v1/chat/completions", {"json": {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}}, "data:image/png;base64"),
    Case("image_too_large", "POST", "/v1/ask", {"json": {"question": RETRY, "images": [
        {"data": b64(png((8000, 8000), "1"))}]}}, "MMRAG_MAX_IMAGE_PIXELS", 413),
    Case("too_many_images", "POST", "/v1/ask", {"json": {"question": RETRY, "images": [{"data": "eA=="}] * 5}},
         "fewer images"),
    Case("unknown_tier", "POST", "/v1/ask", {"json": {"question": RETRY, "tier": "ultra"}}, "tier"),
    Case("request_too_large", "POST", "/v1/ask", {"json": {"question": "x" * 70_000}}, "MMRAG_MAX_REQUEST_BYTES",
         413),
    Case("invalid_text", "POST", "/v1/ask", {"content": rb'{"question": "\ud800"}', "headers": {
        "content-type": "application/json"}}, "UTF-8"),
    Case("invalid_json", "POST", "/v1/ask", {"content": b"[" * 10_000 + b"]" * 10_000, "headers": {
        "content-type": "application/json"}}, "flat objects"),
    Case("invalid_request", "POST", "/v1/ask", {"json": {"not_a_question": 1}}, "POST /v1/ask", 422),
    Case("invalid_request", "GET", "/v1/documents?limit=0", {}, "GET /v1/documents", 422),
    Case("invalid_request", "POST", "/v1/ask", {"content": b'{"question": "x"}'}, "Content-Type: application/json",
         422),  # curl -d without -H: the body is not read as JSON
    Case("invalid_request", "POST", "/v1/documents", {"data": {"tiers": "low"}}, "multipart/form-data", 422),
    Case("invalid_request", "POST", "/v1/chat/completions", {"content": json.dumps(
        {**CHAT, "temperature": float("nan")}).encode(), "headers": {"content-type": "application/json"}}, "finite",
         422),
    Case("bad_request", "POST", "/v1/documents", multipart(part(f'name="file"; filename="{"a" * 5000}.png"')),
         "255 characters"),
    Case("bad_request", "POST", "/v1/ask/upload", multipart(QUESTION_PART, part(
        f'name="images"; filename="{"a" * 5000}.png"')), "255 characters"),
    Case("bad_request", "POST", "/v1/documents", multipart(part('name="file"; filename="a.png"'), content_type=
         "multipart/form-data; boundary="), "boundary"),
    Case("bad_request", "POST", "/v1/ask/upload", multipart(QUESTION_PART, content_type="multipart/form-data"),
         "boundary"),
    Case("bad_request", "POST", "/v1/documents", multipart(*[part(f'name="file"; filename="{i}.png"')
                                                           for i in range(1001)]), "at most 1,000"),
    Case("bad_request", "POST", "/v1/ask/upload", multipart(QUESTION_PART, *[part('name="images"; filename="i.png"')
                                                                             for _ in range(1001)]), "at most 1,000"),
    Case("not_found", "GET", "/v1/nowhere", {}, "/docs", 404),
    # bbox is checked before the page is looked up, so a fixed URL reaches it
    Case("invalid_bbox", "GET", "/v1/pages/any/image?bbox=1,2,3", {}, "x0,y0,x1,y1", param="bbox"),
    Case("method_not_allowed", "PUT", "/v1/ask", {}, "Allow", 405),
    Case("unauthorized", "GET", "/v1/documents", {}, "Bearer", 401, headers={}),
    Case("unknown_page", "GET", "/v1/pages/not-a-page", {}, "GET /v1/documents", 404),
    Case("unsupported_type", "POST", "/v1/documents", {"files": {"file": ("notes.txt", b"plain text")}}, "PDF", 415),
    Case("unknown_job", "GET", "/v1/ingest/job-gone", {}, "GET /v1/ingest", 404),
    Case("path_not_allowed", "POST", "/v1/ingest", {"json": {"paths": ["/etc"]}}, "MMRAG_INGEST_ROOT", 403),
    Case("invalid_path", "POST", "/v1/ingest", {"json": {"paths": ["a\u0000b"]}}, "MMRAG_INGEST_ROOT"),
    Case("no_question", "POST", "/v1/chat/completions", {"json": {**CHAT, "messages": [
        {"role": "system", "content": "hi"}]}}, '"role": "user"'),
    Case("unsupported_parameter", "POST", "/v1/chat/completions", chat(n=2), "`n`", param="n"),
    Case("conflicting_parameters", "POST", "/v1/chat/completions", chat(max_tokens=1, max_completion_tokens=2),
         "max_completion_tokens", param="max_tokens"),
]


@pytest.fixture
async def http(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        yield client


def test_every_kind_is_triggered_below_or_says_why_not():
    triggered = {c.kind for c in CASES}
    assert every_kind() - triggered == set(NOT_TRIGGERED), (
        "classify each new error kind: a Case above, or NOT_TRIGGERED with the reason")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.kind}-{c.method} {c.url.split('?')[0]}")
async def test_each_error_has_a_fix_that_fits_its_route(http, case):
    request = dict(case.request)
    headers = {**case.headers, **request.pop("headers", {})}
    r = await http.request(case.method, case.url, headers=headers, **request)
    assert r.status_code == case.status, r.text
    error = r.json()["error"]
    assert error["type"] == case.kind and error["message"].strip() and error["fix"].strip(), error
    assert case.fits in error["fix"], error
    assert error.get("param") == case.param, error


# --- what the messages say -------------------------------------------------------------------------------


async def test_a_nan_temperature_is_refused_as_not_finite_not_as_out_of_range(http):
    r = await http.post("/v1/chat/completions", content=json.dumps({**CHAT, "temperature": float("nan")}),
                        headers={**AUTH, "content-type": "application/json"})
    message = r.json()["error"]["message"]
    assert "finite number" in message and "less than or equal" not in message, message


@pytest.mark.parametrize("disposition", ['name="file"', "name=\"file\"; filename*=UTF-8''r%C3%A9sum%C3%A9.png"])
async def test_a_file_part_without_a_plain_file_name_is_named_as_such(http, disposition):
    r = await http.post("/v1/documents", **multipart(part(disposition, png()), **AUTH))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "Expected UploadFile" not in error["message"] and "filename" in error["message"], error
    assert "body.file" in error["message"] and 'filename="<name>"' in error["fix"], error


async def test_a_multipart_failure_names_the_parsers_reason_and_the_route(http):
    r = await http.post("/v1/documents", **multipart(part(f'name="file"; filename="{"a" * 5000}.png"'), **AUTH))
    error = r.json()["error"]
    assert "POST /v1/documents" in error["message"] and "header size" in error["message"], error
    assert "JSON" not in error["fix"], error
