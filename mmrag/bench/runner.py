"""Runs every configuration on one model, back to back in one process, and records every engine request.

Two engines, started one after the other with the same settings except caching (one in-process AsyncLLM
at a time): engine A has prefix caching and the processor cache off (no_cache, vision_cache); engine B has
vLLM's caching defaults — prefix caching, the multimodal processor cache and the encoder cache on — and
serves every other configuration; its prefix, processor and encoder caches are reset before each one.
Before each configuration two cold single-page probe prompts time the machine, and during it the CPU time of
other processes is measured, so a reader can tell a ratio from a change in background load.

What a user would run instead of mmrag, and the ablations, send one request per sub-question over the pages it
retrieved (the per-sub-question plans of their layout, rag/plans.build_plans; no synthesis is modelled):

- ``no_cache``: page pixels with a fresh ``multi_modal_uuids`` per request, caches off: the vision encoder runs
  per image per request; ``vision_cache``: the feature store's image tokens, prefix caching off; ``apc_naive``:
  image tokens with vLLM's prefix caching, the question before the pages (naive layout);
- ``vllm_llamaindex``: page pixels with vLLM's defaults, the prompt llama-index's multimodal chat path builds
  (:func:`llamaindex_messages`);
- ``vllm_images_first``: the savvy vLLM user's prompt, images first in retrieval-score order, then the
  question (mmrag's renderer on score-ordered pages).

mmrag's configurations are the answer strategies `mmrag serve` has (rag/plans.py, MMRAG_ANSWER_MODE), each
question planned as rag/pipeline.Pipeline.ask plans it (:func:`answer_plans`: no more pages than
MMRAG_ONE_PROMPT_PAGES, as served, and the workload's answer length for the whole answer):

- ``mmrag_split``: each page of the union of the sub-questions' pages leads a prompt of its own, with the
  sub-questions that found it (rag/plans.split_plans); the parts share the answer's length;
- ``mmrag_joint``: those pages seen together in their stable order, the answer decoded in a part per page
  (choose_answer(JOINT), rag/plans.joint_parts: the same prompt over every page, a line more per part);
- ``mmrag_auto`` (the default): choose_answer(AUTO) per question, then split or joint as it chose: joint for the
  workload's questions that relate their pages (a "Compare ..." part), split for the others;
- ``mmrag_split_warm``, ``mmrag_joint_warm``, ``mmrag_auto_warm``: the same after the production warm-up
  (serving/warmup.warm: pages ranked by how many documents show them, ``warm_share`` of the KV cache);
- ``mmrag_auto_budget``: ``mmrag_auto_warm`` on the smaller resolution policy's keys (a quarter of the tokens).

So a strategy decodes one answer's length per question and shows at most 4 pages, where the per-sub-question
configurations decode it per sub-question over every page they retrieved: what `mmrag serve` does against what
the others do, not the same prompts made cheaper.

The floors, ``floor`` (``mmrag_auto``'s plans) and ``floor_split``, ``floor_joint`` (full run only), run a
strategy's plans and scheduler with every image prefix already in the KV cache: the questions run in batches
whose image prefixes fit in half the KV cache; before each batch every distinct image prefix of it is
prefilled (untimed), then the batch runs timed. What is left is what no cache can remove: the text after the
images, the image tokens in the block that holds the first text tokens, and the decode.

``mixed`` and ``mixed_tiered`` run mmrag's per-sub-question canonical plans (joint's overflow path) on the
mixed-resolution corpus (mmrag/bench/corpus.py: small figures, slides and scanned A4 pages, a 16x spread in image
tokens), the second with the scheduler's short queue (``MIXED_SHORT_TOKENS``, one reserved slot): the TTFT of
the short requests with and without it. ``mixed_standard`` and ``mixed_pooled`` run ``mixed`` with the pages
under the standard tier's bounds (max 448²: the A4 page scaled down) and pooled 2x2 (a quarter of the tokens):
throughput, TTFT and KV share per resolution policy (``MIXED_POLICIES``). They keep per-sub-question plans
because what they measure is the scheduler and the resolution policies over requests of one or two pages of
mixed sizes. Full run only, unless named with --configs.

``<config>@128`` (``LONG_ANSWER_CONFIGS``, full run only): the configurations whose ratios docs/benchmarks.md states,
again at ``LONG_ANSWER_TOKENS`` answer tokens, on the first ``LONG_ANSWER_QUESTIONS`` questions of the same
workload: at 4 tokens prefill decides, at a real answer length decode weighs in.
"""

from __future__ import annotations

import asyncio
import enum
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from PIL import Image
from prometheus_client import REGISTRY

from mmrag.core.keys import ImageKey, ResolutionPolicy
from mmrag.adapters.checkpoint import ModelSource
from mmrag.adapters.hardware import cpu_flags, emulated_isa, native_cpu_dtype
from mmrag.adapters.store import FeatureStore
from rag.order import PagePopularity
from rag.pipeline import PROMPT_FRAME_TOKENS, PipelineConfig
from rag.plans import (AnswerChoice, AnswerMode, build_plans, choice_plans, choose_answer, fit_pages, joint_plan,
                       joint_text)
from retrieval.search import Hit
from mmrag.core.engine import Completion, KVCapacity, Layout, OnText, PromptPlan, SamplingSpec, Usage
from serving.engine.config import EngineConfig, resolve_dtype
from serving.engine.features import FeatureProvider
from serving.engine.inprocess import InProcessEngine
from serving.engine.prompt import PromptRenderer, PromptTokens
from serving.scheduler import KVResidency, Policy, Scheduler, SchedulerConfig
from serving.warmup import rank_by_demand, warm, warm_plan

from mmrag.bench.corpus import MIXED_MAX_PIXELS, BenchCorpus
from mmrag.bench.workload import (PromptImages, Question, Workload, cache_tokens, fits_in_kv, oracle_bound,
                            prefix_bound)

KV_USAGE = "vllm:kv_cache_usage_perc"
# Mixed resolutions: a plan of at most this many image tokens is short (figures and slides, up to two of them);
# one with a scanned A4 page (1026 tokens) is long. mixed_tiered gives the short ones their own queue and a slot.
MIXED_SHORT_TOKENS = 512
MIXED_SHORT_RESERVED = 1


def mixed_policies(min_pixels: int, standard_max_pixels: int) -> dict[str, ResolutionPolicy]:
    """The mixed corpus's resolution policies: every page unscaled; the standard tier's bounds; unscaled and
    pooled 2x2."""
    return {"full": ResolutionPolicy(min_pixels, MIXED_MAX_PIXELS),
            "standard": ResolutionPolicy(min_pixels, standard_max_pixels),
            "pooled": ResolutionPolicy(min_pixels, MIXED_MAX_PIXELS, pool=2)}


class ImageInput(str, enum.Enum):
    TOKENS = "tokens"  # precomputed image tokens from the feature store, keyed by the image key
    FRESH_PIXELS = "fresh_pixels"  # pixels with a fresh multi_modal_uuid per request: no vLLM cache serves them
    PIXELS = "pixels"  # pixels without uuids: vLLM hashes their content, as for any client of `vllm serve`


class PromptStyle(str, enum.Enum):
    MMRAG = "mmrag"  # serving/engine/prompt.PromptRenderer, as the plan's layout says
    IMAGES_FIRST = "images_first"  # the same renderer, images first in the plan's page order, then the question
    LLAMAINDEX = "llamaindex"  # llamaindex_messages()


@dataclass(slots=True, frozen=True)
class ConfigSpec:
    """One configuration. ``answer_mode`` None: one request per sub-question, the per-sub-question plans of
    ``layout`` (rag/plans.build_plans; no synthesis); SPLIT, JOINT or AUTO: the product's strategy, each question
    planned as Pipeline.ask plans it (:func:`answer_plans`). A new strategy or layout is one more line in CONFIGS."""

    name: str
    images: ImageInput
    caching: bool  # engine B (vLLM's caching defaults) or engine A (prefix and processor caches off)
    policy: Policy
    layout: Layout = Layout.CANONICAL  # per sub-question: the page order of each plan (a strategy's: canonical)
    answer_mode: AnswerMode | None = None  # the strategy (rag/plans.py); None: per sub-question
    prompt: PromptStyle = PromptStyle.MMRAG
    warm: bool = False
    budget: bool = False  # the smaller resolution policy's keys
    prefilled: bool = False  # floor: every image prefix in the KV cache before its prompt runs
    mixed: str = ""  # the mixed-resolution corpus, its keys under this policy of MIXED_POLICIES
    tier_queues: bool = False  # the scheduler's short queue (MIXED_SHORT_TOKENS) with a reserved slot
    full_only: bool = False  # left out of --quick unless named with --configs
    # The answer's length: every request's per sub-question, the parts' together for split; None: the workload's
    # (--max-tokens).
    max_tokens: int | None = None
    questions: int | None = None  # the workload's first N questions; None: all of them
    # A joint answer as the product decodes it, in a part per page (True), or as its one prompt (a benchmark that
    # compares one plan shape per question: mmrag/bench/image_input.py).
    joint_in_parts: bool = True

    def __post_init__(self) -> None:
        if self.prompt is not PromptStyle.MMRAG and self.images is ImageInput.TOKENS:
            raise ValueError(f"{self.name}: only pixel configurations render their own prompt style")
        if self.answer_mode is not None and (self.layout is not Layout.CANONICAL
                                             or self.images is not ImageInput.TOKENS):
            raise ValueError(f"{self.name}: a strategy plans as mmrag serves (image tokens, rendered images first): "
                             "give images=TOKENS and layout=CANONICAL, or answer_mode=None for per-sub-question "
                             "plans in another layout")


_T, _PX, _FRESH = ImageInput.TOKENS, ImageInput.PIXELS, ImageInput.FRESH_PIXELS
_NAIVE, _FCFS, _DFS = Layout.NAIVE, Policy.FCFS, Policy.DFS_WEIGHT
_SPLIT, _JOINT, _AUTO = AnswerMode.SPLIT, AnswerMode.JOINT, AnswerMode.AUTO
BASE_CONFIGS = (
    # What users run instead, and the ablations: a request per sub-question. NAIVE keeps the retrieval-score page
    # order; the prompt style decides where the question goes.
    ConfigSpec("no_cache", _FRESH, caching=False, layout=_NAIVE, policy=_FCFS),
    ConfigSpec("vision_cache", _T, caching=False, layout=_NAIVE, policy=_FCFS),
    ConfigSpec("apc_naive", _T, caching=True, layout=_NAIVE, policy=_FCFS),
    ConfigSpec("vllm_llamaindex", _PX, caching=True, layout=_NAIVE, policy=_FCFS, prompt=PromptStyle.LLAMAINDEX),
    ConfigSpec("vllm_images_first", _PX, caching=True, layout=_NAIVE, policy=_FCFS,
               prompt=PromptStyle.IMAGES_FIRST),
    # mmrag serve's strategies (rag/plans.py), from cold caches and after the production warm-up.
    ConfigSpec("mmrag_split", _T, caching=True, policy=_DFS, answer_mode=_SPLIT),
    ConfigSpec("mmrag_joint", _T, caching=True, policy=_DFS, answer_mode=_JOINT),
    ConfigSpec("mmrag_auto", _T, caching=True, policy=_DFS, answer_mode=_AUTO),
    ConfigSpec("mmrag_split_warm", _T, caching=True, policy=_DFS, answer_mode=_SPLIT, warm=True),
    ConfigSpec("mmrag_joint_warm", _T, caching=True, policy=_DFS, answer_mode=_JOINT, warm=True),
    ConfigSpec("mmrag_auto_warm", _T, caching=True, policy=_DFS, answer_mode=_AUTO, warm=True),
    ConfigSpec("mmrag_auto_budget", _T, caching=True, policy=_DFS, answer_mode=_AUTO, warm=True, budget=True),
    # The split's plans in arrival order, none held for a sibling's prefill: what the scheduler's ordering buys
    # (against mmrag_split), at the engine's whole batch with --engine-batch.
    ConfigSpec("mmrag_split_fcfs", _T, caching=True, policy=_FCFS, answer_mode=_SPLIT, full_only=True),
    # Each strategy's plans with every image prefix in the KV cache: the default's in --quick, the others' in the
    # full run.
    ConfigSpec("floor", _T, caching=True, policy=_DFS, answer_mode=_AUTO, prefilled=True),
    ConfigSpec("floor_split", _T, caching=True, policy=_DFS, answer_mode=_SPLIT, prefilled=True, full_only=True),
    ConfigSpec("floor_joint", _T, caching=True, policy=_DFS, answer_mode=_JOINT, prefilled=True, full_only=True),
    # Mixed resolutions: per-sub-question canonical plans (joint's overflow path), on purpose: they measure the
    # scheduler's short queue and the resolution policies over requests of one or two pages of mixed sizes, a
    # spread a split's one-page prompts would narrow. Comparable with the mixed runs before the strategies.
    ConfigSpec("mixed", _T, caching=True, policy=_DFS, mixed="full", full_only=True),
    ConfigSpec("mixed_tiered", _T, caching=True, policy=_DFS, mixed="full", tier_queues=True, full_only=True),
    ConfigSpec("mixed_standard", _T, caching=True, policy=_DFS, mixed="standard", full_only=True),
    ConfigSpec("mixed_pooled", _T, caching=True, policy=_DFS, mixed="pooled", full_only=True),
)

# The ratios docs/benchmarks.md states, measured again at a real answer length in the same run (issue 22): these
# configurations as ``<name>@128``, full run only. At 128 tokens decode is most of a request, so they run on the
# workload's first LONG_ANSWER_QUESTIONS questions (same seed) to keep the full run's time reasonable; their
# ratios compare them with each other, on the same questions.
LONG_ANSWER_TOKENS = 128
LONG_ANSWER_QUESTIONS = 16
LONG_ANSWER_CONFIGS = ("vllm_llamaindex", "vllm_images_first", "mmrag_split_warm", "mmrag_joint_warm",
                       "mmrag_auto_warm", "floor")


def long_answer_name(name: str) -> str:
    """``mmrag_auto_warm`` -> ``mmrag_auto_warm@128``: the same configuration at LONG_ANSWER_TOKENS."""
    return f"{name}@{LONG_ANSWER_TOKENS}"


CONFIGS = BASE_CONFIGS + tuple(
    replace(c, name=long_answer_name(c.name), max_tokens=LONG_ANSWER_TOKENS, questions=LONG_ANSWER_QUESTIONS,
            full_only=True)
    for c in BASE_CONFIGS if c.name in LONG_ANSWER_CONFIGS)


# llama-index's multimodal chat path (llama-index-core 0.14.25, read from its source and checked against it in
# tests/test_bench.py): RetrieverQueryEngine.from_args(retriever=..., llm=..., multimodal=True), which replaces
# the deprecated SimpleMultiModalQueryEngine (llama_index/core/query_engine/multi_modal.py). Its synthesizer
# (llama_index/core/response_synthesizers/base.py) turns each retrieved node, in retrieval-score order, into a
# ChatMessage of the node's content blocks (``get_content_blocks(MetadataMode.LLM)``: its metadata as a text
# block, then its image), and the default ``chat_content_qa_template``, CHAT_CONTENT_QA_PROMPT
# (llama_index/core/prompts/chat_prompts.py), renders: a system message (TEXT_QA_SYSTEM_PROMPT); a user message
# "Context information is below." + a rule, then each node's metadata text and image, then a rule and the
# query. So the images come before the query, after a fixed preamble and each after its own metadata line.
# llama-index-llms-openai's to_openai_message_dict (llama_index/llms/openai/utils.py, which OpenAILike uses)
# sends the blocks as content parts in that order, and Qwen2-VL's chat template keeps it.
# One request per sub-question, all its pages in it: with OpenAILike's default context_window (3,900) llama-index
# counts 2,125 tokens per ImageBlock and splits a 2-page sub-question into a QA call and a sequential refine
# call instead — more work than modelled here, so this configuration is the favourable case for llama-index.
LLAMAINDEX_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\n"
    "Always answer the query using the provided context information, and not prior knowledge.\n"
    "Some rules to follow:\n"
    "1. Never directly reference the given context in your answer.\n"
    "2. Avoid statements like 'Based on the context, ...' or 'The context information ...' or anything along "
    "those lines."
)
LLAMAINDEX_CONTEXT = "Context information is below.\n---------------------"
LLAMAINDEX_QUERY = ("---------------------\nGiven the context information and not prior knowledge, answer the "
                    "query.\nQuery: {query}\nAnswer:")


def llamaindex_messages(query: str, captions: Sequence[str]) -> list[dict[str, Any]]:
    """The OpenAI-style messages llama-index sends for ``query`` over pages with these metadata lines (one per
    page, retrieval-score order; "" for a node without metadata). Images are bare ``{"type": "image"}`` parts."""
    content: list[dict[str, Any]] = []
    pending = [LLAMAINDEX_CONTEXT]
    for caption in captions:
        pending += [caption] if caption else []
        if pending:  # adjacent text blocks of the template come out as one, joined by a newline
            content.append({"type": "text", "text": "\n".join(pending)})
            pending = []
        content.append({"type": "image"})
    content += [{"type": "text", "text": t} for t in pending]
    content.append({"type": "text", "text": LLAMAINDEX_QUERY.format(query=query)})
    return [{"role": "system", "content": LLAMAINDEX_SYSTEM}, {"role": "user", "content": content}]


def page_caption(doc: str, page: int) -> str:
    """The metadata line llama-index puts before a PDF page's image (MetadataMode.LLM of file_name, page_label)."""
    return f"file_name: {doc}\npage_label: {page}"


@dataclass(slots=True)
class Prompts:
    """How a configuration's plans become prompt text."""

    renderer: PromptRenderer
    style: PromptStyle = PromptStyle.MMRAG
    captions: dict[ImageKey, str] = field(default_factory=dict)  # LLAMAINDEX: each page's metadata line

    def render(self, plan: PromptPlan) -> str:
        if self.style is PromptStyle.LLAMAINDEX:
            messages = llamaindex_messages(self.renderer.guard(plan.text), [self.captions[k] for k in plan.images])
            return self.renderer.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if self.style is PromptStyle.IMAGES_FIRST:
            plan = replace(plan, layout=Layout.CANONICAL)  # the renderer puts images first; the order stays
        return self.renderer.render(plan)

    def tokens(self, plan: PromptPlan, tokens: dict[ImageKey, int]) -> PromptTokens:
        return self.renderer.tokens(self.render(plan), [tokens[k] for k in plan.images])


@dataclass(slots=True)
class Keys:
    """One resolution policy's image keys for the corpus."""

    by_page: dict[int, ImageKey]
    tokens: dict[ImageKey, int]


@dataclass(slots=True)
class BenchInputs:
    model: ModelSource
    corpus: BenchCorpus
    workload: Workload
    store: FeatureStore
    full: Keys
    budget: Keys
    engine_config: EngineConfig  # caching on; engine A is the same with caching=False
    mixed_corpus: BenchCorpus | None = None  # the mixed-resolution configurations' pages and keys
    mixed: dict[str, Keys] = field(default_factory=dict)  # by policy name (mixed_policies)
    scheduler_concurrency: int = 4
    warm_share: float = 0.5
    log: Callable[[str], None] = print

    def corpus_for(self, spec: ConfigSpec) -> BenchCorpus:
        return self._mixed(spec)[0] if spec.mixed else self.corpus

    def questions_for(self, spec: ConfigSpec) -> list[Question]:
        return self.workload.questions[:spec.questions]

    def max_tokens_for(self, spec: ConfigSpec) -> int:
        return spec.max_tokens or self.workload.spec.max_tokens

    def pipeline_config(self, spec: ConfigSpec) -> PipelineConfig:
        """What `mmrag serve`'s Pipeline would be configured with on this engine: the engine's image and context
        limits, the configuration's answer length, every plan decoding exactly its length; the rest its defaults
        (MMRAG_ONE_PROMPT_PAGES=4)."""
        return PipelineConfig(max_tokens=self.max_tokens_for(spec), fixed_length=True,
                              max_images_per_prompt=self.engine_config.max_images_per_prompt,
                              max_model_len=self.engine_config.max_model_len)

    def keys_for(self, spec: ConfigSpec) -> Keys:
        if spec.mixed:
            return self._mixed(spec)[1]
        return self.budget if spec.budget else self.full

    def _mixed(self, spec: ConfigSpec) -> tuple[BenchCorpus, Keys]:
        if self.mixed_corpus is None or spec.mixed not in self.mixed:
            raise ValueError(f"{spec.name} needs the mixed-resolution corpus and its keys under {spec.mixed!r} "
                             "(mmrag/bench/corpus.py, runner.mixed_policies)")
        return self.mixed_corpus, self.mixed[spec.mixed]


@dataclass(slots=True)
class PlanRecord:
    question: int
    plan: PromptPlan
    ttft_s: float  # submit to the scheduler -> first token (queue wait included)
    latency_s: float
    usage: Usage
    predicted_cached_image_tokens: int = 0  # what the scheduler's KV estimate said at dispatch


@dataclass(slots=True)
class ConfigResult:
    spec: ConfigSpec
    questions: int = 0  # questions answered (the throughput's numerator)
    answer_tokens: int = 0  # the answer's length (every request's per sub-question; a split's parts together)
    plans: list[PromptPlan] = field(default_factory=list)  # what was submitted, in workload order
    records: list[PlanRecord] = field(default_factory=list)
    question_latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    kv_usage_peak: float = 0.0
    kv_image_share_peak: float = 0.0  # the scheduler's estimate (serving/scheduler.KVResidency)
    vision_forwards: int = 0
    position_oracle_hit_rate: float = 0.0  # any reuse of a page hits, wherever it sits
    prefix_bound_hit_rate: float = 0.0  # what a prefix cache can reach with this configuration's layout
    probe: list[Usage] = field(default_factory=list)
    warm: dict[str, Any] | None = None
    other_cpu_cores: float = 0.0
    steal_cores: float = 0.0
    own_cpu_cores: float = 0.0
    # (cached, total) image tokens of the first image of each prompt, and of the images after it
    first_image_tokens: tuple[int, int] = (0, 0)
    later_image_tokens: tuple[int, int] = (0, 0)
    scheduler: dict[str, int] = field(default_factory=dict)
    answer_modes: dict[str, int] = field(default_factory=dict)  # a strategy's questions by what answered them

    def absorb(self, part: ConfigResult) -> None:
        """Add a timed part of the run (floor's batches): times add up, loads average over the wall time."""
        wall = self.wall_s + part.wall_s
        for name in ("other_cpu_cores", "steal_cores", "own_cpu_cores"):
            setattr(self, name, (getattr(self, name) * self.wall_s + getattr(part, name) * part.wall_s) / wall)
        self.wall_s = wall
        self.questions += part.questions
        self.answer_tokens = part.answer_tokens
        self.plans += part.plans
        self.records += part.records
        self.question_latencies_s += part.question_latencies_s
        self.kv_usage_peak = max(self.kv_usage_peak, part.kv_usage_peak)
        self.kv_image_share_peak = max(self.kv_image_share_peak, part.kv_image_share_peak)
        self.vision_forwards += part.vision_forwards
        for k, v in part.scheduler.items():
            self.scheduler[k] = self.scheduler.get(k, 0) + v


@dataclass(slots=True)
class BenchRun:
    results: dict[str, ConfigResult]
    capacity: KVCapacity
    dtype: str
    engine_start_s: list[float]
    vit_probe_s: float  # a cold single-page prompt as pixels minus the same as image tokens, engine A
    machine: dict[str, Any] = field(default_factory=dict)  # machine_info()


# The CPU flags that decide the engine's speed and its `auto` dtype (mmrag/adapters/hardware.py).
RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU the numbers were measured on: its model, the flags that matter here, its core count."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())  # the first processor's
    flags = cpu_flags(cpuinfo)
    # A VM often names its CPU only "Intel(R) Xeon(R) Processor": family/model/stepping, as the hypervisor
    # reports them, and the flags tell the generation.
    ident = "/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping"))
    return {"cpu_model": fields.get("model name", "unknown"), "cpu_family_model_stepping": ident,
            "cpus": os.cpu_count(), "cpu_flags": {f: f in flags for f in RELEVANT_CPU_FLAGS},
            "native_bf16": native_cpu_dtype(flags) == "bfloat16",
            "emulated_isa": emulated_isa()}  # MMRAG_EMULATE_ISA: the flags above are then the emulated CPU's


# --- engines the scheduler can drive --------------------------------------------------------------------


class PixelEngine:
    """Page pixels to vLLM, the prompt in the configuration's style, through the in-process engine's own
    request loop (``InProcessEngine.run_request``).

    ``fresh_uuids`` (no_cache): a fresh uuid per request keys every vLLM cache, so none can serve the image.
    Otherwise no uuids: vLLM hashes the image content, as it does for any client of `vllm serve`, and its
    processor, encoder and prefix caches work as they do by default. vLLM counts no encoder-cache hits, so
    there each request reports as its vision forwards the images not wholly served from the prefix cache: an
    upper bound (the encoder cache may still hold some of them).
    """

    def __init__(self, inner: InProcessEngine, images: dict[ImageKey, Image.Image], tokens: dict[ImageKey, int],
                 prompts: Prompts, *, fresh_uuids: bool) -> None:
        self.inner = inner
        self.images = images
        self.tokens = tokens
        self.prompts = prompts
        self.fresh_uuids = fresh_uuids
        self.model_name = inner.model_name
        self.random_weights = inner.random_weights

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None,
                       on_text: OnText | None = None) -> Completion:
        started = time.perf_counter()
        request: dict[str, Any] = {"prompt": self.prompts.render(plan),
                                   "multi_modal_data": {"image": [self.images[k] for k in plan.images]}}
        if self.fresh_uuids:
            request["multi_modal_uuids"] = {"image": [f"pixels-{uuid.uuid4().hex}" for _ in plan.images]}
        counts = [self.tokens[k] for k in plan.images]
        completion = await self.inner.run_request(
            plan, request, counts, started=started, vision_encodes=len(plan.images) if self.fresh_uuids else 0,
            on_first_token=on_first_token, on_text=on_text)
        if not self.fresh_uuids:
            usage = completion.usage
            spans = self.inner.renderer.tokens(request["prompt"], counts).image_spans
            usage.vision_encodes = sum(1 for start, n in spans if start + n > usage.cached_tokens)
        return completion

    async def kv_capacity(self) -> KVCapacity:
        return await self.inner.kv_capacity()

    async def batch_capacity(self) -> int:
        return await self.inner.batch_capacity()

    async def close(self) -> None:
        pass


class _FirstTokens:
    """Wraps an engine to timestamp each plan's first token (the scheduler owns the callback slot)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.random_weights = inner.random_weights
        self.first: dict[PromptPlan, float] = {}
        self.predict: Callable[[PromptPlan], int] | None = None  # asked as the scheduler dispatches a plan
        self.predicted: dict[PromptPlan, int] = {}

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None,
                       on_text: OnText | None = None) -> Completion:
        if self.predict is not None:
            self.predicted[plan] = self.predict(plan)

        def stamp() -> None:
            self.first.setdefault(plan, time.perf_counter())
            if on_first_token is not None:
                on_first_token()

        return await self.inner.generate(plan, on_first_token=stamp, on_text=on_text)

    async def kv_capacity(self) -> KVCapacity:
        return await self.inner.kv_capacity()

    async def batch_capacity(self) -> int:
        return await self.inner.batch_capacity()

    async def close(self) -> None:
        pass


# --- one configuration ----------------------------------------------------------------------------------


def workload_plans(spec: ConfigSpec, inputs: BenchInputs, keys: Keys, questions: Sequence[Question]
                   ) -> dict[int, list[PromptPlan]]:
    """Each question's plans by its id, planned in workload order (the global layout with one PagePopularity for
    the run, as one process does)."""
    popularity = PagePopularity() if spec.layout is Layout.GLOBAL else None
    corpus, config = inputs.corpus_for(spec), inputs.pipeline_config(spec)
    plans = {q.qid: question_plans(q, spec, keys, corpus, config, popularity) for q in questions}
    most = max((len(p.images) for ps in plans.values() for p in ps), default=0)
    if most > inputs.engine_config.max_images_per_prompt:
        raise ValueError(f"{spec.name}: a prompt of {most} images, over the engine's max_images_per_prompt="
                         f"{inputs.engine_config.max_images_per_prompt}: raise it in default_engine_config")
    return plans


def workload_answer_modes(spec: ConfigSpec, inputs: BenchInputs, keys: Keys, questions: Sequence[Question]
                          ) -> dict[str, int]:
    """How many of the questions each strategy answered ({"joint": n, "split": m}: what auto chose; a one-page
    split is a joint prompt); {} for a per-sub-question configuration."""
    if spec.answer_mode is None:
        return {}
    corpus, config = inputs.corpus_for(spec), inputs.pipeline_config(spec)
    chosen = Counter(answer_plans(q.text, [s.text for s in q.subs], question_hits(q, keys, corpus), spec.answer_mode,
                                  config)[0].mode.value for q in questions)
    return dict(sorted(chosen.items()))


def question_plans(q: Question, spec: ConfigSpec, keys: Keys, corpus: BenchCorpus, config: PipelineConfig,
                   popularity: PagePopularity | None = None) -> list[PromptPlan]:
    """The plans of this question from its simulated retrieval, each decoding exactly its length: the strategy's
    (:func:`answer_plans`), or rag/plans.build_plans per sub-question in the configuration's layout (the global
    layout reads ``popularity``, which observes each sub-question's pages before this question is planned)."""
    hits = question_hits(q, keys, corpus)
    subs = [s.text for s in q.subs]
    if spec.answer_mode is not None:
        plans = answer_plans(q.text, subs, hits, spec.answer_mode, config, joint_in_parts=spec.joint_in_parts)[1]
    else:
        if popularity is not None:
            for hs in hits:
                popularity.observe(h.image_key for h in hs)
        plans = build_plans(subs, hits, max_tokens=config.max_tokens, layout=spec.layout, popularity=popularity)
    return [replace(p, sampling=fixed_length(p.sampling.max_tokens)) for p in plans]


def answer_plans(question: str, subs: Sequence[str], hits: Sequence[Sequence[Hit]], mode: AnswerMode,
                 config: PipelineConfig, *, joint_in_parts: bool = True) -> tuple[AnswerChoice, list[PromptPlan]]:
    """What Pipeline.ask submits for a question with these sub-questions and hits (none of its own images, no
    tier, figures as the hits show them; rag/pipeline.py ``_pages`` and ``_answer_over``): each sub-question's
    pages cut to one prompt's room (fit_pages), choose_answer's strategy and pages under the engine's limits
    (:func:`prompt_misfit`), then its parts over them (rag/plans.choice_plans: the split's or the joint's, the
    parts sharing ``config.max_tokens``), over the hits of the pages shown. ``joint_in_parts`` False: a joint
    answer as its one prompt (rag/plans.joint_plan), for a benchmark that counts how often each shown image
    recurs (mmrag/bench/figure_keys.py), where the parts would count every image of a question once per part. Joint's
    overflow (a prompt per sub-question, then a synthesis over their answers) cannot be planned before the
    answers exist: it raises, naming the limit to raise."""
    limit = config.max_tokens
    fitted, _ = fit_pages(hits, room=config.max_images_per_prompt, layout=Layout.CANONICAL)
    choice = choose_answer(mode, fitted, question=question, max_pages=config.one_prompt_pages, max_parts=limit,
                           misfit=lambda pages: prompt_misfit(question, subs, pages, fitted, limit, config))
    if choice.overflow:
        raise ValueError(f"{question!r}: {choice.why}. The bench plans no synthesis (it needs the sub-answers): "
                         "raise max_model_len or max_images_per_prompt in default_engine_config")
    dropped = {p.image_key for p in choice.left_out}
    shown = [[h for h in hs if h.image_key not in dropped] for hs in fitted]
    if choice.mode is AnswerMode.JOINT and not joint_in_parts:
        return choice, [joint_plan(question, subs, choice.pages, max_tokens=limit, hits=shown)]
    return choice, [p.plan for p in choice_plans(choice, question, subs, max_tokens=limit, hits=shown,
                                                  min_part_tokens=config.joint_part_min_tokens)]


def prompt_misfit(question: str, subs: Sequence[str], pages: Sequence[Hit], hits: Sequence[Sequence[Hit]],
                  max_tokens: int, config: PipelineConfig) -> str | None:
    """Pipeline._misfit for a question without images of its own: why one prompt over ``pages`` would not fit the
    engine (more images than it takes, or its tokens and the answer's over the context; text counted as UTF-8
    bytes), or None."""
    if len(pages) > config.max_images_per_prompt:
        return f"{len(pages)} images, over max_images_per_prompt={config.max_images_per_prompt}"
    image_tokens = sum(p.image_tokens for p in pages)
    text = len(joint_text(question, subs, pages, 0, hits).encode())
    if image_tokens + text + PROMPT_FRAME_TOKENS + max_tokens > config.max_model_len:
        return (f"{image_tokens} image tokens, up to {text + PROMPT_FRAME_TOKENS} of text and {max_tokens} of answer: "
                f"over max_model_len={config.max_model_len}")
    return None


def fixed_length(max_tokens: int) -> SamplingSpec:
    """Every bench request decodes exactly its answer length: random weights end a sequence at chance points,
    which differ with the prompt, so configurations would otherwise decode different amounts."""
    return SamplingSpec(max_tokens=max_tokens, min_tokens=max_tokens)


def question_hits(q: Question, keys: Keys, corpus: BenchCorpus) -> list[list[Hit]]:
    """Each sub-question's simulated retrieval: its pages in the workload's order, scores falling by rank. No
    margins (Hit.margin 0): no page stands out, and the union keeps each sub-question's ranks."""
    return [[_hit(p, rank, keys, corpus) for rank, p in enumerate(s.pages)] for s in q.subs]


def _hit(page: int, rank: int, keys: Keys, corpus: BenchCorpus) -> Hit:
    p = corpus.pages[page]
    key = keys.by_page[page]
    doc = p.docs[0] if p.docs else 0
    return Hit(page_id=f"bench-page-{page}", doc_id=f"bench-doc-{doc}", doc=f"doc-{doc}.pdf", page=page + 1,
               score=1.0 - 0.1 * rank, snippet=p.title, image_key=key, image_tokens=keys.tokens[key],
               path=str(corpus.root / p.file))


def prompt_images(plans: Sequence[PromptPlan], keys: Keys, prompts: Prompts) -> list[PromptImages]:
    """Each plan's images, their token spans and its tokens as the prefix cache sees them, as rendered."""
    out = []
    tokenizer, pad = prompts.renderer.tokenizer, prompts.renderer.image_pad_id
    for plan in plans:
        text, counts = prompts.render(plan), [keys.tokens[k] for k in plan.images]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        spans = prompts.renderer.tokens(text, counts).image_spans
        out.append(PromptImages(plan.images, spans, cache_tokens(ids, pad, plan.images, counts)))
    return out


def cpu_snapshot() -> tuple[float, float, float]:
    """(CPU seconds the machine spent busy, of those stolen by the hypervisor, of those spent by this process
    and its children — the engine core and its worker), since boot."""
    import psutil  # comes with vLLM

    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + t.irq + t.softirq
    own = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            c = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        own += c.user + c.system
    return busy, t.steal, own


def kv_usage() -> float:
    """vLLM's own KV usage gauge (0..1) from the in-process Prometheus registry."""
    values = [s.value for m in REGISTRY.collect() if m.name == KV_USAGE for s in m.samples]
    return max(values, default=0.0)


async def _sample_kv(peak: list[float], residency: KVResidency, stop: asyncio.Event, period_s: float = 0.1) -> None:
    """Peaks of vLLM's KV usage and of the scheduler's estimate of the image share of the KV cache."""
    while not stop.is_set():
        peak[0] = max(peak[0], kv_usage())
        peak[1] = max(peak[1], residency.share)
        try:
            await asyncio.wait_for(stop.wait(), period_s)
        except TimeoutError:
            pass


async def run_config(engine: Any, spec: ConfigSpec, inputs: BenchInputs, keys: Keys,
                     questions: list[Question] | None = None, plans: dict[int, list[PromptPlan]] | None = None
                     ) -> ConfigResult:
    """The configuration's questions (or these, with these plans) through the scheduler, timed."""
    wl = inputs.workload
    questions = inputs.questions_for(spec) if questions is None else questions
    if plans is None:
        plans = workload_plans(spec, inputs, keys, questions)
    result = ConfigResult(spec, len(questions), inputs.max_tokens_for(spec))
    recorder = _FirstTokens(engine)
    short = ({"short_image_tokens": MIXED_SHORT_TOKENS, "short_reserved": MIXED_SHORT_RESERVED}
             if spec.tier_queues else {})
    sched = Scheduler(recorder, SchedulerConfig(policy=spec.policy, max_concurrency=inputs.scheduler_concurrency,
                                                **short),
                      image_tokens=lambda p: sum(keys.tokens[k] for k in p.images))
    residency = sched.track_kv((await engine.kv_capacity()).tokens)
    recorder.predict = lambda p: residency.resident_prefix(p.images, [keys.tokens[k] for k in p.images])
    result.plans = [p for q in questions for p in plans[q.qid]]

    async def ask(q: Question) -> None:
        started = time.perf_counter()

        async def one(plan: PromptPlan) -> None:
            submitted = time.perf_counter()
            completion = await sched.submit(plan)
            done = time.perf_counter()
            first = recorder.first.get(plan, done)
            result.records.append(PlanRecord(q.qid, plan, first - submitted, done - submitted, completion.usage,
                                             recorder.predicted.get(plan, 0)))

        await asyncio.gather(*(one(p) for p in plans[q.qid]))
        result.question_latencies_s.append(time.perf_counter() - started)

    peak, stop = [0.0, 0.0], asyncio.Event()
    sampler = asyncio.get_running_loop().create_task(_sample_kv(peak, residency, stop))
    cpu_before = cpu_snapshot()
    started = time.perf_counter()
    if wl.spec.rate_qps:
        async def arrive(q: Question) -> None:
            await asyncio.sleep(max(0.0, started + q.arrival_s - time.perf_counter()))
            await ask(q)

        await asyncio.gather(*(arrive(q) for q in questions))
    else:
        queue = iter(questions)

        async def worker() -> None:
            for q in queue:  # one shared iterator: each worker takes the next question when it is free
                await ask(q)

        await asyncio.gather(*(worker() for _ in range(wl.spec.concurrency)))
    result.wall_s = time.perf_counter() - started
    (busy0, steal0, own0), (busy1, steal1, own1) = cpu_before, cpu_snapshot()
    # Other tenants' load while this config ran, in cores: the noise its timings carry.
    result.other_cpu_cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / result.wall_s
    result.steal_cores = (steal1 - steal0) / result.wall_s
    result.own_cpu_cores = (own1 - own0) / result.wall_s
    stop.set()
    await sampler
    result.kv_usage_peak, result.kv_image_share_peak = peak
    result.vision_forwards = sum(r.usage.vision_encodes for r in result.records)
    s = sched.stats
    result.scheduler = {"dispatched": s.dispatched, "gated": s.gated, "fairness_overrides": s.fairness_overrides,
                        "fcfs_fallbacks": s.fcfs_fallbacks, "short_dispatched": s.short_dispatched,
                        "long_held": s.long_held}
    return result


async def probe(engine: InProcessEngine, inputs: BenchInputs, *, reset: bool) -> list[Usage]:
    """Two cold single-page prompts on pages no question asks about: the machine's speed right now."""
    out = []
    sampling = fixed_length(inputs.workload.spec.max_tokens)
    for p in inputs.corpus.probes:
        if reset:
            await engine.reset_prefix_cache()
        plan = PromptPlan(images=(inputs.full.by_page[p.index],), text=f"{p.title}: what does it show?",
                          sampling=sampling)
        out.append((await engine.generate(plan)).usage)
    if reset:
        await engine.reset_prefix_cache()
    return out


async def _warm_up(engine: InProcessEngine, inputs: BenchInputs, keys: Keys) -> tuple[dict[str, Any], set[ImageKey]]:
    """The production warm-up: pages ranked by how many documents show them, as many as fit the share."""
    pages = [(keys.by_page[p.index], keys.tokens[keys.by_page[p.index]]) for p in inputs.corpus.pages for _ in p.docs]
    report = await warm(engine, rank_by_demand(pages), share=inputs.warm_share)
    info = {"pages": len(report.warmed), "did_not_fit": len(report.did_not_fit), "seconds": round(report.seconds, 3),
            "tokens": report.warmed_tokens}
    return info, set(report.warmed)


def _oracles(result: ConfigResult, inputs: BenchInputs, keys: Keys, base: Prompts, own: Prompts,
             capacity: KVCapacity, warmed: set[ImageKey] | None) -> None:
    """The position oracle over the canonical rendering (``base``: the same number for every configuration on
    these keys and questions), and the prefix bound of the configuration's own prompts (``own``) and warm-up.
    A strategy shows each of a question's pages once (at most MMRAG_ONE_PROMPT_PAGES of them), so its image uses
    differ from the per-sub-question plans': its oracle is over its own plans (their canonical rendering is
    themselves), the same for its cold, warm and floor configurations."""
    spec = result.spec
    as_canonical = replace(spec, layout=Layout.CANONICAL)
    by_question = workload_plans(as_canonical, inputs, keys, inputs.questions_for(spec))
    plans = [p for ps in by_question.values() for p in ps]
    canonical = prompt_images(plans, keys, base)
    warm_set = None
    if spec.prefilled:
        warm_set = {k for p in canonical for k in p.keys}
    elif spec.warm:
        warm_set = fits_in_kv(canonical, capacity.tokens, capacity.block_size)
    result.position_oracle_hit_rate = oracle_bound(canonical, capacity.block_size, warm_set)
    if not spec.caching:
        return
    mine = prompt_images(result.plans, keys, own)  # as submitted (a layout may learn as it plans)
    # What was in the cache before the first question: the warm-up's prompts (through the engine's own
    # renderer), or the floor's prefill of every image prefix.
    seen = prompt_images([warm_plan(k) for k in sorted(warmed or (), key=str)], keys, base)
    if spec.prefilled:
        seen = prompt_images([fill_plan(p.keys) for p in mine], keys, own)
    result.prefix_bound_hit_rate = prefix_bound(mine, capacity.block_size, seen)


def _hits_by_position(result: ConfigResult, keys: Keys, prompts: Prompts) -> None:
    """Where the hits were: the first image of each prompt, or the images behind it."""
    first, later = [0, 0], [0, 0]
    for rec in result.records:
        for pos, (start, n) in enumerate(prompts.tokens(rec.plan, keys.tokens).image_spans):
            bucket = first if pos == 0 else later
            bucket[0] += max(0, min(start + n, rec.usage.cached_tokens) - start)
            bucket[1] += n
    result.first_image_tokens, result.later_image_tokens = (first[0], first[1]), (later[0], later[1])


async def _run_prefilled(engine: InProcessEngine, spec: ConfigSpec, inputs: BenchInputs, keys: Keys,
                         prompts: Prompts, capacity: KVCapacity) -> ConfigResult:
    """floor: batches of questions whose distinct image prefixes fit in the warm-up share of the KV cache
    (each charged a whole prompt of its own, so nothing prefilled is evicted before its batch ends); per
    batch, the longest distinct image prefixes are prefilled untimed (a prefix of one is cached with it), then
    the batch runs timed. The timed parts add up to the configuration's wall time."""
    budget = capacity.tokens * inputs.warm_share
    plans = workload_plans(spec, inputs, keys, inputs.questions_for(spec))  # planned once: batches share the order

    def cost(images: tuple[ImageKey, ...]) -> int:
        return prompts.tokens(fill_plan(images), keys.tokens).prompt_tokens + capacity.block_size

    batches: list[tuple[list[Question], set[tuple[ImageKey, ...]]]] = []
    used = 0.0
    for q in inputs.questions_for(spec):
        mine = {p.images for p in plans[q.qid]}
        new = mine - batches[-1][1] if batches else mine
        extra = sum(cost(t) for t in new)
        if not batches or used + extra > budget:
            batches.append(([], set()))
            new, extra, used = mine, sum(cost(t) for t in mine), 0.0
        batches[-1][0].append(q)
        batches[-1][1].update(new)
        used += extra
    result, fill_s, filled = ConfigResult(spec), 0.0, 0
    for questions, prefixes in batches:
        longest = [t for t in prefixes if not any(len(u) > len(t) and u[: len(t)] == t for u in prefixes)]
        t = time.perf_counter()
        await asyncio.gather(*(engine.generate(fill_plan(images)) for images in sorted(longest, key=str)))
        fill_s += time.perf_counter() - t
        filled += len(longest)
        result.absorb(await run_config(engine, spec, inputs, keys, questions, plans))
    result.warm = {"batches": len(batches), "prefixes_prefilled": filled, "seconds": round(fill_s, 3)}
    return result


def fill_plan(images: tuple[ImageKey, ...]) -> PromptPlan:
    """A prompt that caches everything a plan with these images shares with it: the images, in order."""
    return PromptPlan(images=images, text="", sampling=SamplingSpec(max_tokens=1))


async def _cold(engine: InProcessEngine) -> None:
    """Engine B before a configuration: no prefix, processed-image or encoder output left from the last."""
    await engine.reset_prefix_cache()
    await engine.llm.reset_mm_cache()
    await engine.llm.reset_encoder_cache()


async def run_all(inputs: BenchInputs, names: list[str] | None = None) -> BenchRun:
    wanted = [c for c in CONFIGS if names is None or c.name in names]
    images = {inputs.full.by_page[p.index]: inputs.corpus.image(p) for p in inputs.corpus.pages}
    hits = [_hit(p.index, 0, inputs.full, inputs.corpus) for p in inputs.corpus.pages]
    captions = {h.image_key: page_caption(h.doc, h.page) for h in hits}  # llama-index's metadata lines
    features = FeatureProvider.unscoped(inputs.store)
    results: dict[str, ConfigResult] = {}
    starts: list[float] = []
    capacity, dtype, vit_probe = KVCapacity(0, 1), "", 0.0
    for caching in (False, True):
        group = [c for c in wanted if c.caching is caching]
        if not group:
            continue
        config = replace(inputs.engine_config, caching=caching)
        inputs.log(f"starting engine ({'prefix caching on' if caching else 'all caches off'}) ...")
        t = time.perf_counter()
        engine = InProcessEngine.start(inputs.model, features, config)
        starts.append(round(time.perf_counter() - t, 1))
        try:
            capacity = await engine.kv_capacity()
            dtype = str(engine.llm.vllm_config.model_config.dtype).removeprefix("torch.")
            if not caching:
                vit_probe = await _vit_probe(engine, inputs, images)
            base = Prompts(engine.renderer)
            for spec in group:
                keys = inputs.keys_for(spec)
                own = Prompts(engine.renderer, spec.prompt, captions)
                warm_info, warmed = None, None
                probes = await probe(engine, inputs, reset=caching)
                if caching:
                    await _cold(engine)
                if spec.warm:
                    warm_info, warmed = await _warm_up(engine, inputs, keys)
                inputs.log(f"  {spec.name}: {len(inputs.questions_for(spec))} questions ...")
                if spec.prefilled:
                    result = await _run_prefilled(engine, spec, inputs, keys, own, capacity)
                else:
                    target = engine if spec.images is ImageInput.TOKENS else PixelEngine(
                        engine, images, keys.tokens, own, fresh_uuids=spec.images is ImageInput.FRESH_PIXELS)
                    result = await run_config(target, spec, inputs, keys)
                    result.warm = warm_info
                result.probe = probes
                result.answer_modes = workload_answer_modes(spec, inputs, keys, inputs.questions_for(spec))
                _oracles(result, inputs, keys, base, own, capacity, warmed)
                _hits_by_position(result, keys, own)
                results[spec.name] = result
                inputs.log(f"  {spec.name}: {result.wall_s:.1f} s, "
                           f"{result.questions / result.wall_s:.2f} questions/s")
        finally:
            await engine.close()
    return BenchRun({c.name: results[c.name] for c in wanted}, capacity, dtype, starts, vit_probe, machine_info())


async def _vit_probe(engine: InProcessEngine, inputs: BenchInputs, images: dict[ImageKey, Image.Image]) -> float:
    """Seconds the vision encoder adds to a cold single-page prompt: pixels minus image tokens, same page."""
    page = inputs.corpus.pages[-1]  # engine A caches nothing: the probe leaves no trace for the configs
    key = inputs.full.by_page[page.index]
    plan = PromptPlan(images=(key,), text="vision probe", sampling=SamplingSpec(max_tokens=1))
    pixels = PixelEngine(engine, images, inputs.full.tokens, Prompts(engine.renderer), fresh_uuids=True)
    diffs = []
    for _ in range(2):
        px = (await pixels.generate(plan)).usage.ttft_s
        tok = (await engine.generate(plan)).usage.ttft_s
        diffs.append(px - tok)
    return statistics.median(diffs)


def default_engine_config(max_model_len: int = 4096) -> EngineConfig:
    """The same for every configuration: 32-token blocks (CPU attention wants multiples of 32), 1 GiB of KV,
    eager mode (20 s start-up), the dtype `mmrag serve` resolves ``auto`` to on this host (bfloat16 only where
    the CPU runs it natively: AVX512-BF16 or AMX; float32 elsewhere), its engine processes' poll for the next step
    as `mmrag serve` resolves it (MMRAG_ENGINE_SPIN_MS=-1), and room for one prompt over a question's union of pages
    (the workload's 4 sub-questions x 2 pages)."""
    return EngineConfig(block_size=32, kv_cache_gib=1, max_model_len=max_model_len, max_images_per_prompt=8,
                        enforce_eager=True, dtype=resolve_dtype("auto"), max_num_seqs=16)
