"""POST /v1/ask: a question, optionally with images; POST /v1/ask/upload: the same with the images as files.

Two routes, not two content types on one: FastAPI declares one body per route, and a pydantic JSON model and
multipart form fields each document and validate themselves only on a route of their own. Both end in
:func:`_answer`.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile

from ingestion.loaders import ImageTooLargeError, IngestError
from serving.api.conversations import QuestionImage, UnknownConversationError
from serving.api.deps import AuthDep, ServicesDep
from serving.api.errors import ApiError
from serving.api.limits import IMAGE_ROUTES, base64_length
from serving.api.schemas import (CONVERSATION_ID, CONVERSATION_ID_DESCRIPTION, INVALID_REQUEST, UNAUTHORIZED,
                                 AskRequest, AskResponse, error_responses)
from serving.api.services import Services

router = APIRouter(tags=["ask"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED))
ASK_PATH, UPLOAD_PATH = IMAGE_ROUTES

ASK_ERRORS = error_responses({
    400: "Empty or over-long question (`bad_question`), an image-only search with the image channel off "
         "(`image_channel_off`), more images than a question takes (`too_many_images`), or an image that is not "
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

_ANSWER = dict(response_model=AskResponse, response_model_exclude_unset=True, responses=ASK_ERRORS)


# exclude_unset: `sub_answers` stays absent (not null) on an answer that found no pages, as before.
@router.post(ASK_PATH, summary="Answer a question with page citations and cache accounting", **_ANSWER)
async def ask(body: AskRequest, request: Request, services: ServicesDep) -> dict:
    _check_count(len(body.images), services)
    limit = services.settings.max_image_bytes
    blobs = [_from_base64(image.data, f"body.images.{i}.data", limit) for i, image in enumerate(body.images)]
    return await _answer(request, services, body.question, body.docs, blobs, body.conversation_id)


@router.post(UPLOAD_PATH, summary="Answer a question about uploaded images (multipart/form-data)", **_ANSWER)
async def ask_upload(
    request: Request, services: ServicesDep,
    question: Annotated[str, Form(description="The question; it is split into sub-questions.")],
    images: Annotated[list[UploadFile] | None, File(description="Image files the question is about (at most "
                                                    "MMRAG_MAX_QUESTION_IMAGES), each field named `images`.")] = None,
    docs: Annotated[list[str] | None, Form(description="Only search these documents (repeat the field).")] = None,
    conversation_id: Annotated[str | None, Form(pattern=CONVERSATION_ID,
                                                description=CONVERSATION_ID_DESCRIPTION)] = None,
) -> dict:
    _check_count(len(images or ()), services)
    blobs = [await f.read() for f in images or ()]  # the body limit bounds them; decode_image checks each one's size
    return await _answer(request, services, question, docs, blobs, conversation_id)


async def _answer(request: Request, services: Services, question: str, docs: list[str] | None,
                  blobs: list[bytes], conversation_id: str | None) -> dict:
    # Refused at once when full (429); cancelled, its plans and engine requests with it, when the client
    # leaves. Admission counts every outcome in the answers metric.
    async with services.admission.admit():
        answer = await services.admission.until_disconnect(
            request, _ask_with_images(services, question, docs, blobs, conversation_id))
        return answer.to_json()


async def _ask_with_images(services: Services, question: str, docs: list[str] | None, blobs: list[bytes],
                           conversation_id: str | None):
    images, forwards = await _images_of(services, blobs, conversation_id)
    for image in images:  # the scheduler admits plans by their image tokens
        services.pipeline.token_counts.record(image.key, image.tokens)
    answer = await services.pipeline.ask(question, docs=docs, images=[i.key for i in images])
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


def _check_count(n: int, services: Services) -> None:
    settings = services.settings
    most = min(settings.max_question_images, settings.max_images_per_prompt)
    if n > most:
        raise ApiError(400, "too_many_images", f"{n} images sent; a question takes at most {most} (the lower of "
                       f"MMRAG_MAX_QUESTION_IMAGES={settings.max_question_images} and MMRAG_MAX_IMAGES_PER_PROMPT="
                       f"{settings.max_images_per_prompt}, the images one prompt holds)",
                       "send fewer images, or ask about them in separate questions")


def _from_base64(data: str, where: str, max_bytes: int) -> bytes:
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
