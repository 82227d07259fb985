"""Bodies of the OpenAI-compatible routes (POST /v1/chat/completions, GET /v1/models), in the shapes the `openai`
SDK and llama-index's `OpenAILike` parse, plus documented extra fields (`citations`, mmrag's own usage counts):
the SDK keeps unknown fields in ``model_extra``.

Requests ignore fields they do not name (`top_p`, `user`, ...), as clients send them by default; the fields that
would change what comes back and cannot be honoured (`n` > 1, `logprobs`, `tools`, a `response_format` other than
text) are named so that the route refuses them (400 `unsupported_parameter`) instead of answering as if they
were absent. Responses forbid unknown keys, as in schemas.py, so a field added to an answer without a
description here fails loudly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.api.schemas import ANSWER_MODE_DESCRIPTION, MAX_TOKENS_DESCRIPTION, TIER_DESCRIPTION, AnswerModeName, Citation

MODEL_ID = "mmrag"


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- request ---------------------------------------------------------------------------------------------


class TextPart(BaseModel):
    type: Literal["text"] = Field(description="A text part.")
    text: str = Field(description="The text.")


class ImageUrl(BaseModel):
    url: str = Field(description="A data URL, `data:image/png;base64,...` (PNG, JPEG, WebP or TIFF; at most "
                                 "MMRAG_MAX_IMAGE_BYTES decoded). Remote URLs are not fetched.")
    detail: str | None = Field(default=None, description="Accepted and ignored: images are sized by the "
                                                         "encoder's resolution policy.")


class ImagePart(BaseModel):
    type: Literal["image_url"] = Field(description="An image part.")
    image_url: ImageUrl = Field(description="The image, as a data URL.")


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="Who wrote it. The last `user` message is the question; images of every `user` message lead "
                    "its prompts; other text (earlier turns, system prompts) is not used.")
    content: str | list[ContentPart] | None = Field(
        default=None, description="Text, or a list of `text` and `image_url` parts.")


class StreamOptions(BaseModel):
    include_usage: bool = Field(default=False, strict=True,
                                description="Send a last chunk with `usage` (and empty `choices`).")


class ResponseFormat(BaseModel):
    type: str = Field(description="`text` is the one served; `json_object` and `json_schema` are refused "
                                  "(`unsupported_parameter`).")


UNSUPPORTED = "Refused with 400 `unsupported_parameter` (naming it in `error.param`) "


class ChatCompletionRequest(BaseModel):
    model: Literal["mmrag"] = Field(description="The one model served: `mmrag` (GET /v1/models).")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, oldest first; it must "
                                                                  "hold a `user` message.")
    stream: bool = Field(default=False, strict=True, description="Answer as server-sent "
                         "`chat.completion.chunk` events, ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(default=None, description="Options of a streamed answer.")
    max_tokens: int | None = Field(default=None, ge=1, description=MAX_TOKENS_DESCRIPTION)
    max_completion_tokens: int | None = Field(default=None, ge=1, description="The same as `max_tokens` (OpenAI's "
                                              "newer name); both given and different is a 400 "
                                              "(`conflicting_parameters`).")
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False, description="Accepted and "
                                      "ignored: answers are greedy (temperature 0), so that an answer over "
                                      "documents does not vary run to run.")
    n: int | None = Field(default=None, ge=1, description="Choices to generate: 1, the one served. " + UNSUPPORTED
                          + "above 1.")
    logprobs: bool | None = Field(default=None, description="Not computed: " + UNSUPPORTED + "when true.")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="Not computed: " + UNSUPPORTED
                                     + "above 0.")
    tools: list[dict[str, Any]] | None = Field(default=None, description="No tool is ever called: " + UNSUPPORTED
                                               + "when not empty, unless `tool_choice` is `none`.")
    tool_choice: str | dict[str, Any] | None = Field(default=None, description="`none` (or `auto` without "
                                                     "`tools`); " + UNSUPPORTED + "otherwise.")
    response_format: ResponseFormat | None = Field(default=None, description="`{\"type\": \"text\"}`, the one "
                                                   "served; " + UNSUPPORTED + "otherwise.")
    # Not OpenAI's: the openai client sends them as `extra_body={"tier": "low", "answer_mode": "joint"}`.
    tier: str | None = Field(default=None, description="mmrag's own: " + TIER_DESCRIPTION)
    answer_mode: AnswerModeName | None = Field(default=None, description="mmrag's own: " + ANSWER_MODE_DESCRIPTION)


# --- responses -------------------------------------------------------------------------------------------


class PromptTokensDetails(_Response):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the engine's prefix cache.")


class ChatUsage(_Response):
    prompt_tokens: int = Field(description="Prompt tokens over every completion of the answer, images included.")
    completion_tokens: int = Field(description="Generated tokens over every completion.")
    total_tokens: int = Field(description="The two together.")
    prompt_tokens_details: PromptTokensDetails = Field(description="What of the prompt was cached.")
    image_tokens: int = Field(description="Prompt tokens that are image tokens: the pages' and the messages'.")
    cached_image_tokens: int = Field(description="Of those, image tokens served from the prefix cache.")
    vision_encodes: int = Field(description="Vision-encoder forwards done for this request: one per message "
                                            "image whose tokens were not stored yet.")
    image_input: str = Field(description="The form that sent the images to the engine (MMRAG_IMAGE_INPUT): "
                             "`embeds` or `pixels`; empty when no prompt ran.")


class AssistantMessage(_Response):
    role: Literal["assistant"] = Field(description="Always `assistant`.")
    content: str = Field(description="The answer, its citations appended as footnotes (`[1] doc.pdf, page 3`).")


class Choice(_Response):
    index: int = Field(description="Always 0: one choice.")
    message: AssistantMessage = Field(description="The answer.")
    finish_reason: Literal["stop"] = Field(description="Always `stop`.")
    logprobs: None = Field(default=None, description="Always null: not computed.")


class ChatCompletion(_Response):
    id: str = Field(description="Id of this completion.")
    object: Literal["chat.completion"] = Field(description="Always `chat.completion`.")
    created: int = Field(description="Unix time it was answered.")
    model: Literal["mmrag"] = Field(description="The model that answered.")
    choices: list[Choice] = Field(description="One choice.")
    usage: ChatUsage = Field(description="Token and cache accounting over every completion of the answer.")
    citations: list[Citation] = Field(description="The pages the footnotes cite, in footnote order.")


class Delta(_Response):
    role: Literal["assistant"] | None = Field(default=None, description="`assistant`, in the first chunk only.")
    content: str | None = Field(default=None, description="The next piece of the answer.")


class ChunkChoice(_Response):
    index: int = Field(description="Always 0: one choice.")
    delta: Delta = Field(description="What this chunk adds.")
    finish_reason: Literal["stop"] | None = Field(default=None, description="`stop` in the last content chunk.")


class ChatCompletionChunk(_Response):
    id: str = Field(description="Id of the completion; the same in every chunk.")
    object: Literal["chat.completion.chunk"] = Field(description="Always `chat.completion.chunk`.")
    created: int = Field(description="Unix time the answer began.")
    model: Literal["mmrag"] = Field(description="The model that answers.")
    choices: list[ChunkChoice] = Field(description="One choice; empty in the usage chunk.")
    usage: ChatUsage | None = Field(default=None, description="In the last chunk when "
                                    "`stream_options.include_usage` is set, else null.")
    citations: list[Citation] | None = Field(default=None, description="In the chunk with the footnotes.")


class ModelCard(_Response):
    id: Literal["mmrag"] = Field(description="The model id to send as `model`.")
    object: Literal["model"] = Field(description="Always `model`.")
    created: int = Field(description="Unix time; 0: not tracked.")
    owned_by: str = Field(description="Always `mmrag`.")
    served_model: str = Field(description="The VLM that answers behind the RAG pipeline.")
    random_weights: bool = Field(description="True for the random-weight test model: its text is not meaningful.")


class ModelList(_Response):
    object: Literal["list"] = Field(description="Always `list`.")
    data: list[ModelCard] = Field(description="The models served: `mmrag`.")
