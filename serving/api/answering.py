"""The one answer service below the routes: POST /v1/ask (JSON or its event stream), /v1/ask/upload and
/v1/chat/completions each turn their body into a :class:`Question` and call :func:`respond`; how the answer is
rendered (JSON, server-sent events, OpenAI chunks) is all that stays with them.

Here: the checks made before any work (image count, tier), the question's images (sent, or its
conversation's), admission (429 when full; a client that leaves cancels its question), the pipeline's answer,
and the stream's life (errors before the first event are the JSON error with its status; after, a last
``error`` event).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from mmrag.core.keys import KeyLease
from ingestion.loaders import ImageTooLargeError, IngestError
from rag.answer import Answer
from rag.pipeline import Emit, stream_events
from serving.api.admission import ClientGone
from serving.api.conversations import (SEND_AGAIN_FIX, ImagesExpiredError, QuestionImage,
                                        UnknownConversationError)
from serving.api.limits import base64_length, check_tier
from serving.api.services import Services
from serving.engine.features import MissingFeaturesError
from serving.http.errors import ApiError, api_error_of, error_body, hide_paths

# A streamed answer's events (rag/pipeline.py) -> the response body (a route's rendering).
Render = Callable[[AsyncIterator[dict]], AsyncIterator[str]]


@dataclass(slots=True, frozen=True)
class Question:
    """One question as every route asks it."""

    text: str
    docs: list[str] | None = None
    images: tuple[bytes, ...] = ()  # image files, undecoded
    conversation_id: str | None = None
    tier: str | None = None
    answer_mode: str | None = None  # None: MMRAG_ANSWER_MODE
    max_tokens: int | None = None  # None: MMRAG_ANSWER_MAX_TOKENS, which also bounds it
    converse: bool = True  # remember its images under a conversation_id (False: a route that returns none)


async def respond(request: Request, services: Services, question: Question, *, stream: bool, render: Render
                  ) -> dict | StreamingResponse:
    """The answer as JSON (``Answer.to_json()``), or with ``stream`` its events rendered by ``render``.
    Refused before any work when the question asks for more images than a prompt takes or an unknown tier."""
    check(question, services)
    if stream:
        return await _stream(request, services, question, render)
    return (await _admitted(services, request, question, None)).to_json()


def check(question: Question, services: Services) -> None:
    settings = services.settings
    most = min(settings.max_question_images, settings.max_images_per_prompt)
    if len(question.images) > most:
        raise ApiError(400, "too_many_images", f"{len(question.images)} images sent; a question takes at most "
                       f"{most} (the lower of MMRAG_MAX_QUESTION_IMAGES={settings.max_question_images} and "
                       f"MMRAG_MAX_IMAGES_PER_PROMPT={settings.max_images_per_prompt}, the images one prompt holds)",
                       "send fewer images, or ask about them in separate questions")
    check_tier(question.tier, settings.tiers)


async def answer(services: Services, question: Question, emit: Emit | None) -> Answer:
    """The pipeline's answer over the question's images (encoded once, stored, remembered in its conversation
    unless the route returns none). The answer leases those images from before it starts to its last token,
    as the pipeline leases its pages: a document deleted meanwhile, or `mmrag store gc`, keeps their tokens."""
    lease = services.pipeline.lease()
    try:
        images, forwards = await _images_of(services, question, lease)
        for image in images:  # the scheduler admits plans by their image tokens
            services.pipeline.token_counts.record(image.key, image.tokens)
        try:
            result = await services.pipeline.ask(question.text, docs=question.docs, images=[i.key for i in images],
                                                 tier=question.tier, on_event=emit, answer_mode=question.answer_mode,
                                                 max_tokens=question.max_tokens)
        except MissingFeaturesError as exc:
            await _check_stored(services, images, exc)
            raise
        result.usage.vision_encodes += forwards
        if images and question.converse:
            result.extra["conversation_id"] = await services.conversations.remember(images, question.conversation_id)
        if images:
            result.extra["question_images"] = [{"image_key": str(i.key), "image_tokens": i.tokens} for i in images]
        return result
    finally:
        if question.images or question.conversation_id is not None:  # else it took nothing
            await asyncio.to_thread(lease.end)


async def _images_of(services: Services, question: Question, lease: KeyLease) -> tuple[list[QuestionImage], int]:
    """The question's images (sent, or those of its conversation), leased by ``lease``, and the vision forwards
    they cost. A vision service that is down raises VisionServiceError, which errors.py answers with 503
    `vision_unavailable`."""
    if not question.images:
        if question.conversation_id is None:
            return [], 0
        try:
            images = list(await services.conversations.recall(question.conversation_id))
        except UnknownConversationError as exc:
            raise ApiError(404, "unknown_conversation", str(exc), SEND_AGAIN_FIX) from exc
        except ImagesExpiredError as exc:
            raise ApiError(409, "image_expired", str(exc), SEND_AGAIN_FIX) from exc
        if gone := await asyncio.to_thread(lease.take, {i.key for i in images}):
            raise _expired(len(gone))
        return images, 0
    images, forwards = await _prepared(services, question.images)
    if await asyncio.to_thread(lease.take, {i.key for i in images}):
        # Removed (a deletion, a gc) between being stored and being leased: stored again, under the lease now.
        images, more = await _prepared(services, question.images)
        forwards += more
    return images, forwards


async def _prepared(services: Services, blobs: tuple[bytes, ...]) -> tuple[list[QuestionImage], int]:
    try:
        return await services.question_images.prepare(blobs)
    except ImageTooLargeError as exc:
        raise ApiError(413, "image_too_large", str(exc),
                       "downscale or recompress that image and ask again (operators: MMRAG_MAX_IMAGE_BYTES and "
                       "MMRAG_MAX_IMAGE_PIXELS bound a question's image)") from exc
    except IngestError as exc:
        raise ApiError(400, "invalid_image", str(exc), "send that image as a PNG, JPEG, WebP or TIFF file's bytes "
                       "(in base64 in JSON, or as an `images` part of a multipart upload)") from exc


async def _check_stored(services: Services, images: list[QuestionImage], exc: MissingFeaturesError) -> None:
    """A question image whose tokens the engine did not find (a lease that lapsed mid-answer, a store emptied
    by hand): "send it again", not the engine's advice to ingest, which is for pages."""
    gone = await asyncio.to_thread(lambda: [i for i in images if services.store.size(i.key) is None])
    if gone:
        raise _expired(len(gone)) from exc


def _expired(n: int) -> ApiError:
    return ApiError(409, "image_expired", f"the image tokens of {n} of the question's images are no longer stored "
                    "(a deletion or `mmrag store gc` removed them after their lease lapsed)", SEND_AGAIN_FIX)


async def _admitted(services: Services, watched: Request | _Leaving, question: Question, emit: Emit | None
                    ) -> Answer:
    """The answer, admitted: when full it waits its turn while its expected wait is within
    MMRAG_ADMISSION_MAX_WAIT_S, else 429 (serving/api/admission.py); cancelled, its plans and engine requests with
    it, when ``watched`` (the request, or a stream's :class:`_Leaving`) says the client left. Admission counts
    every outcome in the answers metric; the answer's timings start with the seconds it waited there."""
    async with services.admission.admit(watched, services.tenant) as waited:
        answered = await services.admission.until_disconnect(watched, answer(services, question, emit),
                                                             services.tenant)
    answered.extra["timings"] = {"admission_s": round(waited, 4), **answered.extra.get("timings", {})}
    return answered


async def _stream(request: Request, services: Services, question: Question, render: Render) -> StreamingResponse:
    """The answer as events. Errors until retrieval is done (429, a bad question, an unknown document, a
    missing page) are still the JSON error with its status: the stream starts after it; one after that (the
    engine failing) is a last `error` event. A client that leaves cancels the question as without streaming:
    :class:`_Leaving` tells ``until_disconnect`` of it."""
    leaving = _Leaving(request)
    events = stream_events(lambda emit: _admitted(services, leaving, question, emit), stop=leaving.stop)
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
