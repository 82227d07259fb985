"""POST /v1/ask: a question, optionally with images; POST /v1/ask/upload: the same with the images as files.

Two routes, not two content types on one: FastAPI declares one body per route, and a pydantic JSON model and
multipart form fields each document and validate themselves only on a route of their own. Both hand the
question to the answer service (serving/api/answering.py); with `stream` its events go out as server-sent
events (schemas.AskEvent), each ``event: <name>`` and ``data: <the event as JSON>``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import StreamingResponse

from serving.api.answering import Question, from_base64, respond
from serving.api.deps import AuthDep, TenantDep
from serving.api.limits import IMAGE_ROUTES
from serving.api.schemas import (ANSWER_MODE_DESCRIPTION, CONVERSATION_ID, CONVERSATION_ID_DESCRIPTION,
                                 MAX_TOKENS_DESCRIPTION, STREAM_DESCRIPTION, TIER_DESCRIPTION, AnswerModeName,
                                 AskEvent, AskRequest, AskResponse)
from serving.http.schemas import INVALID_REQUEST, UNAUTHORIZED, error_responses

router = APIRouter(tags=["ask"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED))
ASK_PATH, UPLOAD_PATH = IMAGE_ROUTES

ASK_ERRORS = error_responses({
    400: "Empty or over-long question (`bad_question`), a `tier` that is not configured (`unknown_tier`), an "
         "image-only search with the image channel off (`image_channel_off`), more images than a question takes (`too_many_images`), or an image that is not "
         "base64 or not a PNG, JPEG, WebP or TIFF it can decode (`invalid_image`); or a body that cannot be read "
         "(`bad_request`; on /v1/ask/upload, multipart/form-data the parser refuses).",
    404: "A document named in `docs` is not ingested (`unknown_document`), or nothing is (`no_documents`); or the "
         "`conversation_id` of a question without images is unknown or expired (`unknown_conversation`): send "
         "the images again.",
    409: "The tokens of a conversation's images went (`image_expired`): send the images again; a retrieved "
         "page's image tokens are not stored (`missing_image_tokens`): re-ingest it; or every "
         "page is of another vision encoder than the configured one (`stale_index`): run `mmrag reencode` (or re-ingest, or set it back).",
    413: "Request body over MMRAG_MAX_REQUEST_BYTES, plus what the images may take (`request_too_large`); or an "
         "image over MMRAG_MAX_IMAGE_BYTES or MMRAG_MAX_IMAGE_PIXELS (`image_too_large`), or images over "
         "MMRAG_MAX_REQUEST_PIXELS together (`too_many_pixels`).",
    **INVALID_REQUEST,
    429: "The queue of questions waiting for MMRAG_MAX_QUESTIONS_IN_FLIGHT is full, or its expected wait is over "
         "MMRAG_ADMISSION_MAX_WAIT_S, or a waiter reached it (`overloaded`); or the images being "
         "decoded and encoded hold MMRAG_MAX_PIXELS_IN_FLIGHT (`pixels_in_flight`): retry after the "
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


# exclude_unset: `sub_answers` stays absent (not null) on an answer that found no pages, as before.
@router.post(ASK_PATH, summary="Answer a question with page citations and cache accounting", **_ANSWER)
async def ask(body: AskRequest, request: Request, services: TenantDep) -> dict | StreamingResponse:
    limit = services.settings.documents.max_image_bytes
    blobs = tuple(from_base64(image.data, f"body.images.{i}.data", limit) for i, image in enumerate(body.images))
    question = Question(body.question, body.docs, blobs, body.conversation_id, body.tier, body.answer_mode,
                        body.max_tokens)
    return await respond(request, services, question, stream=body.stream, render=sse_frames)


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
    answer_mode: Annotated[AnswerModeName | None, Form(description=ANSWER_MODE_DESCRIPTION)] = None,
    max_tokens: Annotated[int | None, Form(ge=1, description=MAX_TOKENS_DESCRIPTION)] = None,
) -> dict | StreamingResponse:
    blobs = tuple([await f.read() for f in images or ()])  # the body limit bounds them; decode_image checks each
    return await respond(request, services, Question(question, docs, blobs, conversation_id, tier, answer_mode,
                                                     max_tokens), stream=stream, render=sse_frames)


async def sse_frames(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Each event as ``event: <name>`` and ``data: <the event as JSON>``."""
    async for event in events:
        yield f"event: {event['event']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
