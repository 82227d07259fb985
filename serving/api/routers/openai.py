"""POST /v1/chat/completions and GET /v1/models: the OpenAI-compatible face of POST /v1/ask, for the clients
people already have (the `openai` SDK, llama-index's `OpenAILike`, LangChain, Open WebUI).

A chat is not a conversation the pipeline knows: the last user message's text is the question (retrieval and
prompts see it alone), and the images of every user message, oldest first, lead its prompts, through the same
decoding, hashing and encoding as /v1/ask's images. A client resends the history each turn, so an image of an
earlier turn hashes to the same key again: its tokens are not encoded twice and its KV comes from the prefix
cache. Citations end the answer's text as footnotes and come structured in `citations`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from serving.api.answering import Question, from_base64, respond
from serving.api.deps import AuthDep, TenantDep
from serving.api.limits import CHAT_ROUTE
from serving.api.openai_schemas import (MODEL_ID, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatMessage, ImagePart, ModelList, TextPart)
from serving.api.routers.ask import ASK_ERRORS
from serving.api.schemas import FigureCitation
from serving.api.services import Services
from serving.http.errors import ApiError
from serving.http.schemas import UNAUTHORIZED, error_responses

router = APIRouter(tags=["openai"], dependencies=[AuthDep], responses=error_responses(UNAUTHORIZED))

# /v1/ask's errors, but for what a chat has instead of `docs` and `conversation_id`.
CHAT_ERRORS = {
    **ASK_ERRORS,
    **error_responses({
        400: "No `user` message, or its text is empty or over-long (`no_question`, `bad_question`); a `tier` that "
             "is not configured (`unknown_tier`); an image that "
             "is not a base64 data URL of a PNG, JPEG, WebP or TIFF (`invalid_image`); more distinct images than a "
             "question takes (`too_many_images`); an image-only search with the image channel off "
             "(`image_channel_off`); a field that cannot be honoured: `n` > 1, `logprobs`, `top_logprobs`, `tools`, "
             "`tool_choice` or a `response_format` other than text (`unsupported_parameter`, the field in "
             "`error.param`); or `max_tokens` and `max_completion_tokens` that differ (`conflicting_parameters`).",
        404: "Nothing is ingested (`no_documents`).",
        413: "Request body over MMRAG_MAX_REQUEST_BYTES plus what its `image_url` parts may take "
             "(`request_too_large`); or an image over MMRAG_MAX_IMAGE_BYTES or MMRAG_MAX_IMAGE_PIXELS "
             "(`image_too_large`), or images over MMRAG_MAX_REQUEST_PIXELS together (`too_many_pixels`).",
    }),
}


@router.get("/v1/models", summary="The models served (OpenAI shape): `mmrag`", response_model=ModelList)
async def models(services: TenantDep) -> ModelList:
    engine = services.engine
    return ModelList.model_validate({"object": "list", "data": [{
        "id": MODEL_ID, "object": "model", "created": 0, "owned_by": "mmrag",
        "served_model": engine.model_name, "random_weights": engine.random_weights}]})


# One server-sent event, as an SSE parser (and schemathesis) reads it: its `data` line is JSON or `[DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "A ChatCompletionChunk as JSON, `{\"error\": {...}}`, or `[DONE]`."}}}
CHUNKS = {"description": "The answer, or with `stream` true server-sent events: `data: <a ChatCompletionChunk as "
          "JSON>` each, the answer's tokens as `delta.content`, its footnotes (and `citations`) in the last "
          "content chunk, `usage` in a chunk of its own when `stream_options.include_usage` is set, then "
          "`data: [DONE]`. An error after the stream began is a last `data: {\"error\": {...}}`.",
          "content": {"text/event-stream": {"schema": _SSE_EVENT, "example": (
              'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "mmrag", '
              '"choices": [{"index": 0, "delta": {"content": "The"}, "finish_reason": null}]}\n\n'
              'data: [DONE]\n\n')}}}


@router.post(CHAT_ROUTE, summary="Answer the last user message from the corpus (OpenAI chat shape)",
             response_model=ChatCompletion, responses={**CHAT_ERRORS, 200: CHUNKS})
async def chat_completions(body: ChatCompletionRequest, request: Request, services: TenantDep
                           ) -> ChatCompletion | StreamingResponse:
    refuse_unsupported(body)
    question = Question(_question(body.messages), images=_images(body.messages, services), tier=body.tier,
                        answer_mode=body.answer_mode, max_tokens=answer_max_tokens(body), converse=False)
    head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": MODEL_ID}
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    answered = await respond(request, services, question, stream=body.stream,
                             render=lambda events: _chunks(events, head, include_usage))
    if isinstance(answered, StreamingResponse):
        return answered
    return ChatCompletion.model_validate({
        **head, "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": answered["answer"] + endnotes(answered)}}],
        "usage": chat_usage(answered["usage"]), "citations": answered["citations"]})


async def _chunks(events: AsyncIterator[dict], head: dict, include_usage: bool) -> AsyncIterator[str]:
    """/v1/ask's answer events (schemas.AskEvent) as OpenAI chunks: its cancellation on a client that leaves
    and its errors are that stream's, only the rendering differs."""

    def chunk(delta: dict | None, finish: str | None = None, **extra) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        body = ChatCompletionChunk.model_validate({**head, "object": "chat.completion.chunk", "choices": choices,
                                                   **extra})
        return f"data: {body.model_dump_json(exclude_unset=True)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    async for event in events:
        if event["event"] == "token":
            yield chunk({"content": event["text"]})
        elif event["event"] == "done":
            answer = event["answer"]
            yield chunk({"content": endnotes(answer)}, "stop", citations=answer["citations"])
            if include_usage:
                yield chunk(None, usage=chat_usage(answer["usage"]))
        elif event["event"] == "error":
            yield f"data: {json.dumps({'error': event['error']}, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


def endnotes(answer: dict) -> str:
    """What ends a chat answer's text: when the model has random weights, a line that says so (a chat client shows
    the text alone: /v1/ask's ``model.note`` never reaches its reader), then its footnotes, last."""
    note = (answer.get("model") or {}).get("note")
    return (f"\n\n({note})" if note else "") + footnotes(answer["citations"])


def footnotes(citations: list[dict]) -> str:
    """The citations as footnotes after the answer, one a line: ``[1] doc.pdf, page 3``, and the figure where the
    hit was one (``[2] report.pdf, page 23, Figure 3: Revenue by quarter``); empty without any."""
    lines = [f"[{i}] {c['doc']}, page {c['page']}{_figure_note(c.get('figure'))}" for i, c in enumerate(citations, 1)]
    return "\n\n" + "\n".join(lines) if lines else ""


def _figure_note(figure: dict | None) -> str:
    return "" if figure is None else f", {FigureCitation.model_validate(figure).reference()}"


def chat_usage(usage: dict) -> dict:
    """An answer's usage (``Answer.to_json()["usage"]``) in the OpenAI shape, mmrag's image counts kept."""
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]},
            **{k: usage[k] for k in ("image_tokens", "cached_image_tokens", "vision_encodes", "image_input")}}


def answer_max_tokens(body: ChatCompletionRequest) -> int | None:
    """The answer's token bound: `max_completion_tokens` or `max_tokens` (one meaning, two names)."""
    given = {name: value for name in ("max_completion_tokens", "max_tokens")
             if (value := getattr(body, name)) is not None}
    if len(set(given.values())) > 1:
        raise ApiError(400, "conflicting_parameters", f"max_completion_tokens={given['max_completion_tokens']} and "
                       f"max_tokens={given['max_tokens']} disagree: they are one bound under two names",
                       "send one of them (`max_completion_tokens`, OpenAI's newer name)", param="max_tokens")
    return next(iter(given.values()), None)


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    """400 `unsupported_parameter` for an OpenAI field that would change what comes back and cannot be
    honoured: answering as if it were absent would hand the client something else than it asked for."""
    refused = next(_unsupported(body), None)
    if refused is not None:
        param, why, fix = refused
        raise ApiError(400, "unsupported_parameter", f"unsupported parameter `{param}`: {why}", fix, param=param)


def _unsupported(body: ChatCompletionRequest) -> Iterator[tuple[str, str, str]]:
    """(field, why it cannot be honoured, the fix) for each such field of ``body``."""
    if body.n is not None and body.n > 1:
        yield ("n", f"n={body.n}: one choice is generated per request",
               "leave `n` out (or 1); answers are greedy, so another request gives the same choice")
    if body.logprobs:
        yield "logprobs", "token log-probabilities are not computed", "leave `logprobs` out (or false)"
    if body.top_logprobs:
        yield ("top_logprobs", f"top_logprobs={body.top_logprobs}: token log-probabilities are not computed",
               "leave `top_logprobs` out (or 0)")
    if body.tool_choice not in (None, "none", "auto"):
        yield ("tool_choice", f"tool_choice={json.dumps(body.tool_choice)}: the model calls no tool",
               'leave `tool_choice` out (or "none")')
    if body.tools and body.tool_choice != "none":
        yield ("tools", f"{len(body.tools)} tools: the model answers from the corpus and calls no tool",
               'leave `tools` out, or set `tool_choice` to "none"')
    if body.response_format is not None and body.response_format.type != "text":
        yield ("response_format", f"type {body.response_format.type!r}: answers are text with citations",
               'leave `response_format` out (or `{"type": "text"}`)')


def _question(messages: list[ChatMessage]) -> str:
    """The last user message's text (its text parts, one a line)."""
    for message in reversed(messages):
        if message.role == "user":
            content = message.content
            if isinstance(content, str):
                return content
            return "\n".join(p.text for p in content or () if isinstance(p, TextPart))
    raise ApiError(400, "no_question", "the messages hold no `user` message: there is no question to answer",
                   "end the messages with `{\"role\": \"user\", \"content\": \"<question>\"}`")


def _images(messages: list[ChatMessage], services: Services) -> tuple[bytes, ...]:
    """The images of every user message, oldest first, each distinct URL once (a resent history repeats them)."""
    urls: dict[str, str] = {}  # url -> where it first came
    for i, message in enumerate(messages):
        if message.role == "user" and isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    urls.setdefault(part.image_url.url, f"body.messages.{i}.content.{j}.image_url.url")
    for url, where in urls.items():
        if not url.startswith("data:"):
            raise ApiError(400, "invalid_image", f"{where}: not a data URL (remote images are not fetched)",
                           "send the image inline as `data:image/png;base64,<base64>`")
    return tuple(from_base64(url, where, services.settings.documents.max_image_bytes) for url, where in urls.items())
