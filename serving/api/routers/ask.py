"""POST /v1/ask: a question, optionally with images; POST /v1/ask/upload: the same with the images as files.

Two routes, not two content types on one: FastAPI declares one body per route, and a pydantic JSON model and
multipart form fields each document and validate themselves only on a route of their own. Both end in
:func:`_answer`, or with `stream` in :func:`_stream`: server-sent events (schemas.AskEvent), each
``event: <name>`` and ``data: <the event as JSON>``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import StreamingResponse

from core.keys import UnknownTierError
from ingestion.loaders import ImageTooLargeError, IngestError
from serving.api.conversations import QuestionImage, UnknownConversationError
from serving.api.deps import AuthDep, TenantDep
from rag.answer import Answer
from rag.pipeline import Emit, stream_events
from serving.api.admission import ClientGone
from serving.api.errors import ApiError, api_error_of, error_body, hide_paths
from serving.api.limits import IMAGE_ROUTES, base64_length
from serving.api.schemas import (CONVERSATION_ID, CONVERSATION_ID_DESCRIPTION, INVALID_REQUEST, STREAM_DESCRIPTION,
                                 TIER_DESCRIPTION, UNAUTHORIZED, AskEvent, AskRequest, AskResponse,
                                 error_responses)
from serving.api.services import Services

router = APIRouter(tags=["ask"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED))
ASK_PATH, UPLOAD_PATH = IMAGE_ROUTES

ASK_ERRORS = error_responses({
    400: "Empty or over-long question (`bad_question`), a `tier` that is not configured (`unknown_tier`), an "
         "image-only search with the image channel off (`image_channel_off`), more images than a question takes (`too_many_images`), or an image that is not "
         "base64 or not a PNG, JPEG, WebP or TIFF it can decode (`invalid_image`).",
    404: "A document named in `docs` is not ingested (`unknown_document`), or nothing is (`no_documents`); or the "
         "`conversation_id` of a question without images is unknown or expired (`unknown_conversation`): send "
         "the images again.",
    409: "A retrieved page's image tokens are not stored (`missing_image_tokens`): re-ingest it; or every "
         "page is of another vision encoder than the configured one (`stale_index`): re-ingest or set it back.",
    413: "Request body over MMRAG_MAX_REQUEST_BYTES, plus what the images may take (`request_too_large`); or an "
         "image over MMRAG_MAX_IMAGE_BYTES or MMRAG_MAX_IMAGE_PIXELS (`image_too_large`).",
    **INVALID_REQUEST,
    429: "More questions are being answered than the server takes at once (`overloaded`): retry after the "
         "`Retry-After` seconds.",
    502: "The engine rejected the prompt (`engine_rejected`).",
    503: "The engine, Qdrant, the feature store or (for a question with images) the vision service does not "
         "answer (`engine_unavailable`, `retrieval_unavailable`, `feature_store_unavailable`, "
         "`vision_unavailable`, ...).",
})

def _event_schema() -> dict:
    """One server-sent event: its name, and its data, an AskEvent as JSON (the models it refers to are the
    answer's, already in /openapi.json)."""
    data = AskEvent.model_json_schema(ref_template="#/components/schemas/{model}")
    data.pop("$defs", None)
    return {"type": "object", "required": ["event", "data"], "properties": {
        "event": {**data["properties"]["event"], "description": "The event's name: its data's `event`."},
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data,
                 "description": "The event, as JSON."}}}


SSE = {"description": "The answer, or with `stream` true a stream of server-sent events, one per step: "
       "`event: <event>` then `data: <the AskEvent as JSON>`.",
       "content": {"text/event-stream": {"schema": _event_schema(), "example": (
           'event: sub_questions\ndata: {"event": "sub_questions", "sub_questions": ["..."], '
           '"sub_question_source": "rules"}\n\nevent: token\ndata: {"event": "token", "text": "The"}\n\n')}}}
_ANSWER = dict(response_model=AskResponse, response_model_exclude_unset=True, responses={**ASK_ERRORS, 200: SSE})
Work = Callable[[Emit | None], Awaitable[Answer]]  # one question, told to emit its events (None: not streamed)
Render = Callable[[AsyncIterator[dict]], AsyncIterator[str]]  # a streamed answer's events -> the response body


# exclude_unset: `sub_answers` stays absent (not null) on an answer that found no pages, as before.
@router.post(ASK_PATH, summary="Answer a question with page citations and cache accounting", **_ANSWER)
async def ask(body: AskRequest, request: Request, services: TenantDep) -> dict | StreamingResponse:
    check_count(len(body.images), services)
    limit = services.settings.max_image_bytes
    blobs = [from_base64(image.data, f"body.images.{i}.data", limit) for i, image in enumerate(body.images)]
    check_tier(body.tier, services)
    return await respond(request, services, body.stream, lambda emit: ask_with_images(
        services, body.question, body.docs, blobs, body.conversation_id, emit, tier=body.tier))


@router.post(UPLOAD_PATH, summary="Answer a question about uploaded images (multipart/form-data)", **_ANSWER)
async def ask_upload(
    request: Request, services: TenantDep,
    question: Annotated[str, Form(description="The question; it is split into sub-questions.")],
    images: Annotated[list[UploadFile] | None, File(description="Image files the question is about (at most "
                                                    "MMRAG_MAX_QUESTION_IMAGES), each field named `images`.")] = None,
    docs: Annotated[list[str] | None, Form(description="Only search these documents (repeat the field).")] = None,
    conversation_id: Annotated[str | None, Form(pattern=CONVERSATION_ID,
                                                description=CONVERSATION_ID_DESCRIPTION)] = None,
    stream: Annotated[bool, Form(description=STREAM_DESCRIPTION)] = False,
    tier: Annotated[str | None, Form(description=TIER_DESCRIPTION)] = None,
) -> dict | StreamingResponse:
    check_count(len(images or ()), services)
    check_tier(tier, services)
    blobs = [await f.read() for f in images or ()]  # the body limit bounds them; decode_image checks each one's size
    return await respond(request, services, stream, lambda emit: ask_with_images(
        services, question, docs, blobs, conversation_id, emit, tier=tier))


async def respond(request: Request, services: Services, stream: bool, work: Work, render: Render | None = None
                  ) -> dict | StreamingResponse:
    """The answer of ``work`` as JSON, or with ``stream`` as events rendered by ``render`` (default: this
    route's server-sent events; /v1/chat/completions renders OpenAI chunks from the same events)."""
    if stream:
        return await _stream(request, services, work, render or sse_frames)
    return (await _admitted(services, request, work, None)).to_json()


async def _admitted(services: Services, watched: Request | _Leaving, work: Work, emit: Emit | None) -> Answer:
    """``work(emit)``, admitted: refused at once when full (429); cancelled, its plans and engine requests
    with it, when ``watched`` (the request, or a stream's :class:`_Leaving`) says the client left. Admission
    counts every outcome in the answers metric."""
    async with services.admission.admit():
        return await services.admission.until_disconnect(watched, work(emit))


async def _stream(request: Request, services: Services, work: Work, render: Render) -> StreamingResponse:
    """The answer as server-sent events. Errors until retrieval is done (429, a bad question, an unknown
    document, a missing page) are still the JSON error with its status: the stream starts after it; one
    after that (the engine failing) is a last `error` event. A client that leaves cancels the question as
    without streaming: :class:`_Leaving` tells ``until_disconnect`` of it."""
    leaving = _Leaving(request)
    events = stream_events(lambda emit: _admitted(services, leaving, work, emit), stop=leaving.stop)
    head = []
    async for event in events:
        head.append(event)
        if event["event"] in ("citations", "done"):
            break

    async def answer_events() -> AsyncIterator[dict]:
        try:
            for event in head:
                yield event
            async for event in events:
                yield event
        except ClientGone:
            pass  # nobody reads the rest
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            error = api_error_of(exc) or ApiError(500, "answer_failed", f"{type(exc).__name__}: {exc}",
                                                  "ask again; if it fails again, see the server log")
            yield {"event": "error",
                   **error_body(error.kind, hide_paths(request, error.message), hide_paths(request, error.fix))}

    return StreamingResponse(render(answer_events()), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def sse_frames(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Each event as ``event: <name>`` and ``data: <the event as JSON>``."""
    async for event in events:
        yield f"event: {event['event']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class _Leaving:
    """What ``until_disconnect`` watches for a streamed answer: the request's disconnect, or the end of the
    response's stream before its last event (Starlette ends it when it sees the client leave), the first of
    the two. Both mean nobody reads on, and the question is cancelled and counted as such."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.ended = asyncio.Event()

    def stop(self, task: asyncio.Task) -> None:
        self.ended.set()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # ClientGone, read: nobody else will

    async def receive(self) -> dict:
        message = asyncio.ensure_future(self.request.receive())
        ended = asyncio.ensure_future(self.ended.wait())
        try:
            await asyncio.wait({message, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            message.cancel()
            ended.cancel()
        return message.result() if message.done() and not message.cancelled() else {"type": "http.disconnect"}


async def ask_with_images(services: Services, question: str, docs: list[str] | None, blobs: list[bytes],
                           conversation_id: str | None, emit: Emit | None, *, tier: str | None = None) -> Answer:
    images, forwards = await _images_of(services, blobs, conversation_id)
    for image in images:  # the scheduler admits plans by their image tokens
        services.pipeline.token_counts.record(image.key, image.tokens)
    answer = await services.pipeline.ask(question, docs=docs, images=[i.key for i in images], tier=tier,
                                         on_event=emit)
    answer.usage.vision_encodes += forwards
    if images:
        answer.extra["conversation_id"] = services.conversations.remember(images, conversation_id)
        answer.extra["question_images"] = [{"image_key": str(i.key), "image_tokens": i.tokens} for i in images]
    return answer


async def _images_of(services: Services, blobs: list[bytes], conversation_id: str | None
                     ) -> tuple[list[QuestionImage], int]:
    """The question's images (sent, or those of its conversation) and the vision forwards they cost. A vision
    service that is down raises VisionServiceError, which errors.py answers with 503 `vision_unavailable`."""
    if not blobs:
        if conversation_id is None:
            return [], 0
        try:
            return list(services.conversations.recall(conversation_id)), 0
        except UnknownConversationError as exc:
            raise ApiError(404, "unknown_conversation", str(exc)) from exc
    try:
        return await services.question_images.prepare(blobs)
    except ImageTooLargeError as exc:
        raise ApiError(413, "image_too_large", str(exc)) from exc
    except IngestError as exc:
        raise ApiError(400, "invalid_image", str(exc)) from exc


def check_tier(tier: str | None, services: Services) -> None:
    """An unknown tier is refused before any work, naming the configured ones."""
    if tier is None:
        return
    try:
        services.settings.tier_table.policy(tier)
    except UnknownTierError as exc:
        raise ApiError(400, "unknown_tier", str(exc), "ask for one of the configured tiers, or leave `tier` out "
                       "for the standard one") from exc


def check_count(n: int, services: Services) -> None:
    settings = services.settings
    most = min(settings.max_question_images, settings.max_images_per_prompt)
    if n > most:
        raise ApiError(400, "too_many_images", f"{n} images sent; a question takes at most {most} (the lower of "
                       f"MMRAG_MAX_QUESTION_IMAGES={settings.max_question_images} and MMRAG_MAX_IMAGES_PER_PROMPT="
                       f"{settings.max_images_per_prompt}, the images one prompt holds)",
                       "send fewer images, or ask about them in separate questions")


def from_base64(data: str, where: str, max_bytes: int) -> bytes:
    """An image's bytes from base64 or a base64 data URL; its length is checked before anything is decoded."""
    if data.startswith("data:"):
        header, _, data = data.partition(",")
        if not header.endswith(";base64"):
            raise ApiError(400, "invalid_image", f"{where}: a data URL without `;base64`",
                           "send `data:<media type>;base64,<base64>` or the bare base64")
    if len(data) > base64_length(max_bytes):
        raise ApiError(413, "image_too_large", f"{where}: {len(data):,} base64 characters, over the "
                       f"{base64_length(max_bytes):,} of an image of MMRAG_MAX_IMAGE_BYTES={max_bytes:,} bytes",
                       "downscale or recompress the image, or raise MMRAG_MAX_IMAGE_BYTES")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(400, "invalid_image", f"{where} is not base64 ({exc})",
                       "send the image file's bytes in standard base64 (A-Z a-z 0-9 + /, padded with =)") from exc
