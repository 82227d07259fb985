"""The engine contract: what an engine takes (a prompt plan) and gives back (a completion with per-request
cache accounting), and the Engine protocol that rag/ and serving/ program against.

Contracts only: no I/O, no vLLM. The engines (serving/engine/) implement it; the RAG pipeline (rag/) calls
it through an injected submit, so it never imports serving.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import Protocol

from mmrag.core.keys import ImageKey


class Layout(str, enum.Enum):
    """How a question's pages become plans (rag/pipeline.plan_prompts). Every layout but NAIVE renders
    [system][images][text] (serving/engine/prompt.py): prompts that share leading images share a KV prefix."""

    # One plan per sub-question, pages in the batch's canonical order (rag/order.canonical_order).
    CANONICAL = "canonical"
    # One plan per sub-question, pages in the process-wide popularity order (rag/order.PagePopularity).
    GLOBAL = "global"
    # One plan per (sub-question, page), then a synthesis: every page leads a prompt, none are seen together.
    PER_PAGE = "per_page"
    # [system][text][images] in retrieval-score order: the question comes first, so two prompts diverge
    # before any image. Kept as the baseline the benchmark and the scheduler tests compare against.
    NAIVE = "naive"


class ImageInput(str, enum.Enum):
    """How a prompt's images reach vLLM (MMRAG_IMAGE_INPUT): the deployment form.

    EMBEDS (form A, the default): the image tokens ingestion stored (the vision service's ViT + projector), as
    vLLM's ``image_embeds``; the engine runs no vision encoder. PIXELS (form B): the page's stored pixels, which
    vLLM's own encoder turns into tokens under its encoder cache. Either way the image's mmrag key is its
    ``multi_modal_uuid`` (serving/engine/images.py), so every vLLM cache is keyed by content, encoder version and
    resolution policy."""

    EMBEDS = "embeds"
    PIXELS = "pixels"


@dataclass(slots=True, frozen=True)
class SamplingSpec:
    max_tokens: int = 64
    temperature: float = 0.0  # greedy by default: answers over documents should not vary run to run
    stop: tuple[str, ...] = ()
    json_schema: str | None = None  # guided decoding (structured output) when set
    min_tokens: int = 0  # no end of sequence before this many tokens (the benchmark's fixed-length stand-ins)


@dataclass(slots=True, frozen=True)
class PromptPlan:
    """Everything that determines a prompt. Identical plans render byte-identical prompts."""

    images: tuple[ImageKey, ...]
    text: str
    system_prompt_id: str = "default"
    sampling: SamplingSpec = SamplingSpec()
    layout: Layout = Layout.CANONICAL
    # Scopes the engine's prefix cache (vLLM's cache_salt, folded into the first KV block's hash): plans with
    # different salts never share KV. Each tenant's plans carry its own; "" shares with every unsalted plan.
    cache_salt: str = ""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    image_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (vLLM's own count)
    cached_image_tokens: int = 0  # of those, image tokens
    vision_encodes: int = 0  # vision forwards done for this request (0 when every page was ingested)
    completion_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    image_input: str = ""  # the form that sent the images (ImageInput's value); "" before any completion

    def add(self, other: Usage) -> None:
        for name in self.__slots__:
            if name == "image_input":  # one engine, one form: not a sum
                self.image_input = self.image_input or other.image_input
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    usage: Usage
    model: str
    finish_reason: str | None = None
    replica: str = ""  # which engine instance served it (remote: the replica URL)


@dataclass(slots=True, frozen=True)
class KVCapacity:
    blocks: int
    block_size: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


# Told each piece of generated text as the engine streams it; the pieces concatenate to ``Completion.text``.
OnText = Callable[[str], None]


class Engine(Protocol):
    model_name: str
    random_weights: bool

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None,
                       on_text: OnText | None = None) -> Completion:
        """Run one plan. ``on_first_token`` fires once prefill is done (its KV is then reusable); ``on_text``
        gets the answer's text as it is generated (what a streamed answer shows before the completion)."""
        ...

    async def kv_capacity(self) -> KVCapacity:
        """The engine's KV cache size (all replicas together for a remote engine)."""
        ...

    async def batch_capacity(self) -> int:
        """Sequences the engine runs in one batch (vLLM's max_num_seqs), all replicas together: how many plans
        the scheduler lets in at once unless MMRAG_MAX_CONCURRENCY sets it."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (tests and benchmarks start from a cold cache with it)."""
        ...

    async def close(self) -> None: ...


class EngineWrapper:
    """An engine around ``inner`` that changes only ``generate`` (metering, salting): the rest goes through."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.random_weights = inner.random_weights

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None,
                       on_text: OnText | None = None) -> Completion:
        return await self.inner.generate(plan, on_first_token=on_first_token, on_text=on_text)

    async def kv_capacity(self) -> KVCapacity:
        return await self.inner.kv_capacity()

    async def batch_capacity(self) -> int:
        return await self.inner.batch_capacity()

    async def reset_prefix_cache(self) -> None:
        await self.inner.reset_prefix_cache()

    async def close(self) -> None:
        await self.inner.close()


class Submit(Protocol):
    """Where plans go: straight to ``engine.generate``, or through the prefix-aware scheduler (serving/scheduler)."""

    def __call__(self, plan: PromptPlan, *, on_text: OnText | None = None) -> Awaitable[Completion]: ...


class ImageTokenCounts:
    """Image tokens per image key, learned from retrieval payloads (the pipeline records them as it plans);
    the scheduler's admission by image tokens reads them. One object, shared by both, built by the wiring."""

    def __init__(self) -> None:
        self._counts: dict[ImageKey, int] = {}

    def record(self, key: ImageKey, tokens: int) -> None:
        self._counts[key] = tokens

    def of_plan(self, plan: PromptPlan) -> int:
        return sum(self._counts.get(k, 0) for k in plan.images)
