"""`mmrag bench --e2e`: what a user feels, through each public interface, on one `vllm serve` replica (issues 22, 40).

The same questions (:func:`make_questions`), the same pages and the same engine flags for every side, at each
answer length of ``E2ESpec.lengths`` (4, 128 and 512 tokens in the full run; ``--max-tokens N`` runs N only),
greedy, a closed loop of ``concurrency`` questions in flight, every answer read as a stream.

**The questions** are of three classes, drawn interleaved in a fixed cycle (:data:`CLASS_CYCLE`: 3/8 compound,
3/8 comparison, 1/4 one-part), so every class meets the same warm state and the same neighbours in the loop:

- **compound**: 2 or 3 clauses, each asking about one figure ("What is the trend of revenue by quarter in Figure
  3, and which quarter peaks for churn by quarter in Figure 5?");
- **comparison**: two figures compared, in the three forms the rule decomposer recognises ("Compare A in Figure 2
  and B in Figure 5", "What is the difference between A in Figure 2 and B in Figure 5?", "How does A in Figure 2
  compare to B in Figure 5?"); a comparison is what `auto` answers over its pages seen together (joint), and the
  targets give it its own bounds, so it has as large a share as compound questions, not the quarter at least the
  issue asks: 12 of the full run's 32 questions, enough for a p50 of its own;
- **one-part**: one clause about one figure.

Figures are drawn by Zipf over popularity; the rule decomposer splits compound and comparison questions into one
sub-question per figure (the JSON's ``decomposed_as_designed`` checks that of mmrag's answers).

The sides:

- **mmrag**: `mmrag serve` as a child process (MMRAG_ENGINE_URLS at the replica, MMRAG_ANSWER_MAX_TOKENS the
  longest length), asked over `POST /v1/ask` with ``"stream": true`` and the length as ``max_tokens``; its
  default strategy (``auto``, which picks split or joint per question; the answers' ``answer_mode`` and
  ``answer_mode_reason`` are counted in ``auto_choices``). TTFT is the first generated text the client sees: a
  split answer's first ``token`` event is its first part's heading, sent before anything is generated, and is
  not counted (:func:`first_generated`). It warms the replica at start-up as it does by default
  (MMRAG_WARM_TOP=-1), before the clock: a fresh process per run, since what it learns is per process, so every
  run starts warm and equal. The answer cache is off (MMRAG_ANSWER_CACHE=false) in every run but the repeats
  run: a question drawn twice must cost twice here.
- **mmrag_split**, **mmrag_joint** (at the reference length only, below): the same, each question asked with
  ``answer_mode`` "split" (every shown page leads a prompt of its own) or "joint" (one prompt over the pages;
  overflowing into a prompt per sub-question and a synthesis when they do not fit) — the two strategies `auto`
  chooses between, each on every question.
- **mmrag_model_decomposer** (reference length only): MMRAG_DECOMPOSER=model, MMRAG_DECOMPOSE_FIXED_TOKENS=N: the
  model decodes exactly N tokens per question, a stand-in for a real model's decomposition
  (:func:`decompose_stand_in` says how N is computed; a random-weight model's reply is then rejected and the rules
  split, so sub-questions stay the same).
- **floor**: every image already in KV. mmrag's own plans for the default strategy at that length (its pipeline,
  built in this process over mmrag's index by the caller's ``floor_pipeline``, with a recording ``submit`` that
  keeps every plan an answer submits: an answer's parts (a split's, or a joint answer's), a one-prompt answer,
  or joint's overflow's sub-answers and synthesis), then, in batches whose distinct prompts fit half the KV cache,
  each batch's images prefilled untimed (each plan's system prompt and images, without its text: the text of a
  question is never in KV before it is asked, so it is computed in the timed run, as mmrag's own run computes
  it) and its questions run timed through the same remote engine, a closed loop of the same concurrency. One
  item of the loop is one question: its plans run at once as the pipeline runs them (an overflow's synthesis, the
  text-only plan, after the others), timed together; its TTFT is the first token of the plan the answer streams
  first (the first part, the one prompt, the synthesis). Runs before 2026-12-05 prefilled each plan's text too.
- **llamaindex** (one-shot), as its documentation builds multimodal RAG: ``ImageNode`` pages (the OCR text
  embedded for retrieval, the page image for the model) in a ``QdrantVectorStore`` behind ``VectorStoreIndex``,
  its retriever (top-k as mmrag's), and ``RetrieverQueryEngine.from_args(retriever, llm=OpenAILike(...),
  multimodal=True, streaming=True)``: its synthesizer turns each node into its content blocks (metadata line,
  image) inside ``CHAT_CONTENT_QA_PROMPT`` and OpenAILike sends the images as ``image_url`` parts. ``aquery``;
  the first streamed delta is its TTFT. llama-index counts every image as 2,125 tokens
  (``ImageBlock.aestimate_tokens``, an OpenAI 2048x1536 figure) where this model spends 256, so at the replica's
  real context (4,096) its compact synthesizer would split 3 pages into a QA call and two sequential refine
  calls; OpenAILike is told a context window with room for its estimate (:func:`llamaindex_context_window`),
  so every question is one request, as on a long-context model: the favourable case for llama-index (the
  JSON's ``engine_requests_per_question`` shows it).
- **llamaindex_subq**: ``SubQuestionQueryEngine.from_defaults`` with mmrag's question generator
  (``MMRAGQuestionGenerator(Decomposer(None))``: the same rule splitter, so both decompose alike), one
  ``QueryEngineTool`` over the one-shot engine built the same way but without streaming, ``use_async=True`` and a
  streaming synthesizer over the same OpenAILike; ``aquery``, TTFT the first token of the final answer. The tool's
  engine does not stream because SubQuestionQueryEngine reads each sub-answer with ``str(response)``, which
  drains a streamed response on a new event loop in a worker thread while blocking this one
  (``async_utils.asyncio_run``): every sub-answer of every question in flight would run one at a time (tried:
  two questions of two sub-questions on a 0.5 s fake LLM took 3.0 s, and asyncio reported destroyed tasks).
  llama-index has one LLM setting, so sub-answers are as long as the answer. It drops a failed sub-question
  silently (a logged warning); the run checks every sub-question came back and fails otherwise.

**The repeats run** (reference length, after the sides): a fresh `mmrag serve` with the answer cache on
(MMRAG_ANSWER_CACHE=true, its store emptied first) asked a stream of ``E2ESpec.asks`` questions drawn by Zipf over
the question set (:func:`repeat_stream`), so questions repeat; the closed loop as above. Reported apart
(``repeats``): questions/s, the latency p50 of hits and of misses at the client, the hit rate from each answer's
``usage.answer_cache``, and a hit's time at the server (its answer's stage ``timings``, summed).

**One replica** serves every side and length, started once with ``VLLM_SERVER_DEV_MODE=1`` and
``max_images_per_prompt`` 12; before every run its prefix, multimodal-processor and encoder caches are reset
(``POST /reset_prefix_cache``, ``/reset_mm_cache``, ``/reset_encoder_cache``), so each starts from the same cold
state. One replica rather than one per side: the flags are identical by construction, start-up (the model load)
is paid once, and the sides run one after the other anyway; the counters are read as before/after differences.

**The reference length** is 128 tokens when it is among the lengths, else the first length asked: the mmrag
variants and the repeats run run there, and the targets that name one length are checked there (a one-length
run, such as the smoke test's ``--max-tokens 8``, runs and checks everything at that length).

Per side and length (``by_length``): questions/s, latency and TTFT p50/p99 (client side), and from the replica's
Prometheus counters before and after (:func:`engine_breakdown`) engine requests, prompt and generated tokens per
question and the prefix-cache hit rate; the asked pages cited (:func:`summarize`). For mmrag also where its time
goes (:func:`mmrag_breakdown`): its answers' stage timings and, from its own counters, what decomposition sends.

Per side, length and class (``by_class``, :func:`class_report`): the same client-side figures over that class's
questions, and their ratios to the llama-index one-shot's on the same questions. A class's questions share one
closed loop with the others, so its questions/s is no wall-clock figure: it is estimated as questions / (the sum
of their latencies / concurrency), the rate at which ``concurrency`` questions of that class alone, each taking
the latency it took, would finish (over the whole set the same estimate is the loop's wall time, near enough).
Engine counters cannot be split by class (vLLM does not label requests): they stay per side.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import numpy as np
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.response.schema import AsyncStreamingResponse
from llama_index.core.query_engine import RetrieverQueryEngine, SubQuestionQueryEngine
from llama_index.core.response_synthesizers import get_response_synthesizer
from llama_index.core.schema import ImageNode
from llama_index.core.tools import QueryEngineTool
from llama_index.llms.openai_like import OpenAILike
from llama_index.vector_stores.qdrant import QdrantVectorStore
from pydantic import PrivateAttr

from mmrag.adapters.checkpoint import checkpoint_fingerprint, fingerprint_name
from mmrag.bench.corpus import BenchCorpus
from mmrag.bench.workload import zipf_probabilities
from mmrag.core.engine import Completion, Engine, PromptPlan, Usage
from mmrag.devkit.ports import free_port
from rag.decompose import Decomposer, MMRAGQuestionGenerator, RuleDecomposer
from serving.engine.config import EngineConfig
from serving.readiness import ServerStartError, answers_200, wait_until_ready
from serving.vllm_launch import DEV_MODE, ServerHandle, start_dev_replica as start_replica

if TYPE_CHECKING:
    from mmrag.adapters.embed import TextEmbedder
    from mmrag.core.payload import PagePayload
    from rag.pipeline import Pipeline

# A clause about one figure: compound questions join 2-3 of them, a one-part question is one.
_ASKS = (
    "what is the trend of {what} in Figure {n}",
    "which quarter peaks for {what} in Figure {n}",
    "how large is the change in {what} in Figure {n}",
    "what does Figure {n} show about {what}",
)
# Two figures compared, in the forms rag/decompose.py's rules split into one sub-question per figure (_COMPARE,
# _DIFFERENCE, _HOW_COMPARE) and rag/plans.relates_across reads as relating pages.
_COMPARES = (
    "Compare the {a} in Figure {m} and the {b} in Figure {n}.",
    "What is the difference between the {a} in Figure {m} and the {b} in Figure {n}?",
    "How does the {a} in Figure {m} compare to the {b} in Figure {n}?",
)
COMPOUND, COMPARISON, ONE_PART = "compound", "comparison", "one_part"
CLASSES = (COMPOUND, COMPARISON, ONE_PART)
# The classes of questions 0, 1, 2, ... in turn: interleaved, 3/8 compound, 3/8 comparison, 1/4 one-part.
CLASS_CYCLE = (COMPOUND, COMPARISON, ONE_PART, COMPOUND, COMPARISON, ONE_PART, COMPOUND, COMPARISON)

LENGTHS = (4, 128, 512)  # answer tokens of the full run
REFERENCE_LENGTH = 128
MAX_IMAGES_PER_PROMPT = 12  # the union of up to 4 sub-questions' top-3 pages in one prompt
LLAMAINDEX_COLLECTION = "bench_pages"
LLAMAINDEX_IMAGE_TOKENS = 2125  # what llama-index counts per image (ImageBlock.aestimate_tokens)
WARM_TOP = -1  # `mmrag serve`'s default: warm every page that fits before the first question
MAX_SUB_QUESTIONS = 4  # mmrag's MMRAG_MAX_SUB_QUESTIONS default; the llama-index peer splits with the same rules
CHARS_PER_TOKEN = 4  # Qwen's tokenizer on English JSON, roughly: the model decomposer's stand-in length
FLOOR_TEXT_TOKENS = 512  # a floor plan's KV beyond its image tokens (text, template), for batching
REPEAT_FACTOR = 3  # the repeats run's asks per question of the set, unless E2ESpec.repeat_asks says otherwise

MMRAG = "mmrag"
MMRAG_SPLIT = "mmrag_split"
MMRAG_JOINT = "mmrag_joint"
MMRAG_MODEL_DECOMPOSER = "mmrag_model_decomposer"
FLOOR = "floor"
LLAMAINDEX = "llamaindex"
LLAMAINDEX_SUBQ = "llamaindex_subq"
REPEATS = "repeats"  # the answer-cache run (module docstring); not a side of by_length
# The order they run in at each length: the floor right after mmrag (it opens the index mmrag serve held).
SIDES = (MMRAG, FLOOR, MMRAG_SPLIT, MMRAG_JOINT, MMRAG_MODEL_DECOMPOSER, LLAMAINDEX, LLAMAINDEX_SUBQ)
REFERENCE_ONLY = (MMRAG_SPLIT, MMRAG_JOINT, MMRAG_MODEL_DECOMPOSER)
AUTO_SIDES = (MMRAG, MMRAG_MODEL_DECOMPOSER)  # the sides whose strategy `auto` chooses: auto_choices counts them

# Issue 40's targets: questions/s of the default over the llama-index one-shot at the reference length, overall
# (wall clock) and per class (estimated, module docstring); at every length no class below EVERY_CLASS_AT_LEAST.
QPS_OVER_LLAMAINDEX = {"overall": 1.6, COMPOUND: 2.0, ONE_PART: 1.5, COMPARISON: 1.3}
EVERY_CLASS_AT_LEAST = 1.0
TTFT_OVER_LLAMAINDEX = {"overall": 0.2, COMPARISON: 0.8}  # TTFT p50, at most, at the reference length
OVER_FLOOR = 0.7  # questions/s of the default over the floor's, at least
ANSWER_CACHE_HIT_P50_S = 0.05  # a repeated question answered from the answer cache, p50, at most
GENERATED_OVER_LLAMAINDEX = 1.1  # generated tokens per question, at most

T = TypeVar("T")


class E2EError(RuntimeError):
    """A side failed: a server did not start or answered an error; the message says which and where the log is."""


@dataclass(slots=True, frozen=True)
class E2ESpec:
    questions: int
    concurrency: int = 4
    lengths: tuple[int, ...] = LENGTHS  # answer tokens, each run in turn: every side at every length
    top_k: int = 3  # pages per retrieval on every side (mmrag: per sub-question)
    zipf_s: float = 1.0
    seed: int = 0
    repeat_asks: int = 0  # the repeats run's stream (0: REPEAT_FACTOR x questions)

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1 or len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"lengths must be distinct answer lengths of at least 1 token, got {self.lengths}")
        if self.questions < 1 or self.repeat_asks < 0:
            raise ValueError(f"questions must be at least 1 and repeat_asks at least 0, got {self.questions} and "
                             f"{self.repeat_asks}")

    @property
    def reference_length(self) -> int:
        """Where the mmrag variants and the repeats run run, and single-length targets are checked."""
        return REFERENCE_LENGTH if REFERENCE_LENGTH in self.lengths else self.lengths[0]

    @property
    def asks(self) -> int:
        """Questions asked in the repeats run."""
        return self.repeat_asks or REPEAT_FACTOR * self.questions

    def sides_at(self, length: int) -> tuple[str, ...]:
        return tuple(s for s in SIDES if s not in REFERENCE_ONLY or length == self.reference_length)


@dataclass(slots=True, frozen=True)
class E2EQuestion:
    text: str
    pages: tuple[int, ...]  # the figures it asks about (page indices), one per designed sub-question
    kind: str = COMPOUND  # its class: COMPOUND, COMPARISON or ONE_PART


def make_questions(corpus: BenchCorpus, spec: E2ESpec) -> list[E2EQuestion]:
    """Deterministic questions of the three classes in :data:`CLASS_CYCLE` order (module docstring): each figure
    by Zipf over popularity, named by its number and its title's subject ("revenue by quarter"), the figures of
    one question distinct, joined so the rule splitter recovers one sub-question per figure."""
    rng = np.random.default_rng([spec.seed, zlib.crc32(b"e2e-questions")])
    n = len(corpus.pages)
    probs = zipf_probabilities(n, spec.zipf_s)
    what = [_subject(p.title) for p in corpus.pages]
    out = []
    for i in range(spec.questions):
        kind = CLASS_CYCLE[i % len(CLASS_CYCLE)]
        size = {COMPOUND: int(rng.integers(2, 4)), COMPARISON: 2, ONE_PART: 1}[kind]
        pages = tuple(int(p) for p in rng.choice(n, size=min(n, size), replace=False, p=probs))
        if kind == COMPARISON and len(pages) == 2:
            m, k = pages
            text = _COMPARES[int(rng.integers(len(_COMPARES)))].format(a=what[m], m=m + 1, b=what[k], n=k + 1)
        else:
            clauses = [_ASKS[int(rng.integers(len(_ASKS)))].format(what=what[p], n=p + 1) for p in pages]
            if len(clauses) == 1:
                text = f"{clauses[0]}?"
            elif len(clauses) == 2:
                text = f"{clauses[0]}, and {clauses[1]}?"
            else:
                text = "; ".join(clauses[:-1]) + f"; and {clauses[-1]}?"
        out.append(E2EQuestion(text[0].upper() + text[1:], pages, kind))
    return out


def _subject(title: str) -> str:
    return title.partition(": ")[2] or title  # "Figure 3: headcount by quarter" -> "headcount by quarter"


def repeat_stream(questions: int, spec: E2ESpec) -> list[int]:
    """The repeats run's asks, as indices into the question set: ``spec.asks`` draws by Zipf (``spec.zipf_s``)
    over the set, ranked by a seeded permutation so that no class is the most asked by construction."""
    rng = np.random.default_rng([spec.seed, zlib.crc32(b"e2e-repeats")])
    rank = rng.permutation(questions)
    draws = rng.choice(questions, size=spec.asks, p=zipf_probabilities(questions, spec.zipf_s))
    return [int(rank[d]) for d in draws]


def decompose_stand_in(questions: Sequence[E2EQuestion]) -> dict:
    """The tokens a real model's decomposition would decode: its reply is the rules' sub-questions as the JSON
    the model decomposer asks for (with ``"together": true`` on a comparison, which needs its pages seen
    together), at ~4 characters per token, averaged over the questions."""
    chars = [len(stand_in_reply(q)) for q in questions]
    mean = sum(chars) / len(chars)
    return {"fixed_tokens": max(1, round(mean / CHARS_PER_TOKEN)), "mean_reply_chars": round(mean, 1),
            "chars_per_token": CHARS_PER_TOKEN,
            "how": 'round(mean over the questions of len(json.dumps({"sub_questions": <the rules\' sub-questions>'
                   ', "together": true on a comparison})) / ' f"{CHARS_PER_TOKEN})"}


def stand_in_reply(q: E2EQuestion) -> str:
    """What a model that decomposed ``q`` as the rules do would reply."""
    reply: dict[str, Any] = {"sub_questions": RuleDecomposer(max_n=MAX_SUB_QUESTIONS).split(q.text)}
    if q.kind == COMPARISON:
        reply["together"] = True
    return json.dumps(reply)


# --- one side's outcome ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    latency_s: float
    ttft_s: float | None  # first generated text of the answer as the client sees it; None if none came
    answer: str
    cited: tuple[int, ...]  # page indices cited (mmrag, floor) or given to the model (llama-index)
    asked: tuple[int, ...]
    kind: str = COMPOUND  # the question's class
    extra: dict = field(default_factory=dict)


async def closed_loop(items: Sequence[T], concurrency: int,
                      ask: Callable[[T], Awaitable[Outcome]]) -> tuple[list[Outcome], float]:
    """``concurrency`` items in flight, in order; the outcomes in item order and the wall time."""
    results: list[Outcome | None] = [None] * len(items)
    queue = list(enumerate(items))[::-1]

    async def worker() -> None:
        while queue:
            i, item = queue.pop()
            results[i] = await ask(item)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None], time.perf_counter() - start


def summarize(outcomes: Sequence[Outcome], wall_s: float) -> dict:
    lat = [o.latency_s for o in outcomes]
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    asked = sum(len(o.asked) for o in outcomes)
    found = sum(len(set(o.asked) & set(o.cited)) for o in outcomes)
    return {
        "questions": len(outcomes), "wall_s": round(wall_s, 3),
        "questions_per_s": round(len(outcomes) / wall_s, 4) if wall_s else 0.0,
        **_percentiles("latency", lat), **_percentiles("ttft", ttft),
        "answers_streamed": len(ttft),
        "answers_with_citations": sum(1 for o in outcomes if o.cited and o.answer),
        "asked_pages_cited": round(found / asked, 3) if asked else 0.0,  # retrieval recall of the asked figures
        # the pages it showed the model (mmrag, the floor) or retrieved into its prompts (llama-index), per question
        "pages_cited_per_question": round(sum(len(set(o.cited)) for o in outcomes) / len(outcomes), 2)
        if outcomes else 0.0,
    }


def _percentiles(name: str, values: Sequence[float]) -> dict:
    if not values:
        return {f"{name}_mean_s": None, f"{name}_p50_s": None, f"{name}_p99_s": None}
    a = np.asarray(values)
    return {f"{name}_mean_s": round(float(a.mean()), 4), f"{name}_p50_s": round(float(np.percentile(a, 50)), 4),
            f"{name}_p99_s": round(float(np.percentile(a, 99)), 4)}


def _sample(o: Outcome) -> dict:
    return {"answer": o.answer, "cited_pages": list(o.cited), "asked_pages": list(o.asked), "class": o.kind}


# --- per class, and auto's choices ----------------------------------------------------------------------------

QPS_BY_CLASS_HOW = ("questions / (sum of their latencies / concurrency): the class's questions share one closed "
                    "loop with the others, so this estimates the rate concurrency questions of the class alone "
                    "would finish at, each taking the latency it took")


def class_summary(outcomes: Sequence[Outcome], concurrency: int) -> dict[str, dict]:
    """Per class present: :func:`summarize` over its questions, questions/s estimated (module docstring)."""
    out = {}
    for kind in CLASSES:
        mine = [o for o in outcomes if o.kind == kind]
        if mine:
            s = summarize(mine, sum(o.latency_s for o in mine) / concurrency)
            del s["wall_s"]  # no wall clock of its own
            out[kind] = s
    return out


def class_report(outcomes: dict[str, dict[str, Sequence[Outcome]]], concurrency: int) -> dict[str, dict]:
    """``by_class``: per length and side (``outcomes[length][side]``), each class's summary and, where the
    llama-index one-shot ran at that length, its questions/s and TTFT p50 over llama-index's on the class."""
    report: dict[str, dict] = {}
    for length, sides in outcomes.items():
        rows = {side: class_summary(os, concurrency) for side, os in sides.items()}
        base = rows.get(LLAMAINDEX, {})
        for side, classes in rows.items():
            for kind, s in classes.items():
                if kind in base:
                    s["questions_per_s_over_llamaindex"] = _ratio(s["questions_per_s"],
                                                                  base[kind]["questions_per_s"])
                    s["ttft_p50_over_llamaindex"] = _ratio(s["ttft_p50_s"], base[kind]["ttft_p50_s"])
        report[length] = rows
    return report


def _reason_rule(reason: str | None) -> str:
    """An ``answer_mode_reason`` as its rule: numbers as N ("its 3 parts found..." and "its 2 parts ..." are one
    rule)."""
    return re.sub(r"\d+", "N", reason) if reason else "none"


def choice_counts(outcomes: Iterable[Outcome]) -> dict:
    """How often each strategy was chosen (``answer_mode``), and by which rule (``answer_mode_reason``)."""
    outcomes = list(outcomes)
    return {"questions": len(outcomes),
            "modes": _counts(o.extra.get("answer_mode") or "none" for o in outcomes),
            "reasons": _counts(_reason_rule(o.extra.get("answer_mode_reason")) for o in outcomes)}


def auto_choices(outcomes: Sequence[Outcome]) -> dict:
    """``auto_choices`` of one side's run: :func:`choice_counts` overall and per class."""
    return {"overall": choice_counts(outcomes),
            "by_class": {kind: choice_counts(o for o in outcomes if o.kind == kind)
                         for kind in CLASSES if any(o.kind == kind for o in outcomes)}}


def _counts(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


# --- Prometheus counters before and after a run --------------------------------------------------------------

_VLLM = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
         "vllm:time_to_first_token_seconds")
_VLLM_COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                  "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
_MMRAG = ("mmrag_queue_wait_seconds", "mmrag_ttft_seconds")
_MMRAG_COUNTERS = ("mmrag_engine_requests_total", "mmrag_prompt_tokens_total", "mmrag_completion_tokens_total")
DRAIN_WAIT_S = 1.5  # the app drains scheduler waits into its histogram every second (Services.start_metrics_drain)


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics, summed over labels (one replica or one app: the labels are constant)."""
    from serving.metrics import parse_samples, sample_total

    resp = await client.get(f"{url}/metrics")
    resp.raise_for_status()
    samples = parse_samples(resp.text)
    return {name: sample_total(samples, name) for name in samples}


def delta(before: dict[str, float], after: dict[str, float], names: Sequence[str]) -> dict[str, float]:
    keys = [k for n in names for k in ((f"{n}_sum", f"{n}_count") if not n.endswith("_total") else (n,))]
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}


def engine_breakdown(d: dict[str, float], questions: int) -> dict:
    """Engine seconds per question by phase, requests, tokens and prefix-cache hits, over every request the
    replica served in the run."""
    per_q = {f"engine_{phase}_s": round(d[f"vllm:request_{phase}_time_seconds_sum"] / questions, 4)
             for phase in ("queue", "prefill", "decode")}
    hits, queries = d["vllm:prefix_cache_hits_total"], d["vllm:prefix_cache_queries_total"]
    ttft_n = d["vllm:time_to_first_token_seconds_count"]
    return {**per_q,
            "replica_ttft_mean_s": round(d["vllm:time_to_first_token_seconds_sum"] / ttft_n, 4) if ttft_n else None,
            "engine_requests_per_question": round(d["vllm:request_success_total"] / questions, 3),
            "prompt_tokens_per_question": round(d["vllm:prompt_tokens_total"] / questions, 1),
            "generation_tokens_per_question": round(d["vllm:generation_tokens_total"] / questions, 1),
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0}


# --- processes ---------------------------------------------------------------------------------------------

RESETS = ("reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache")


async def reset_caches(client: httpx.AsyncClient, url: str, *, attempts: int = 20) -> None:
    """The replica back to a cold state: no cached prefix, processed image or encoder output. vLLM refuses a
    prefix reset while blocks are held (``{"success": false}``): a request still finishing, so it is retried."""
    for route in RESETS:
        for _ in range(attempts):
            resp = await client.post(f"{url}/{route}")
            if resp.status_code == 404:
                raise E2EError(f"{url} has no POST /{route}: start the replica with {DEV_MODE}=1 (start_replica "
                               "does)")
            resp.raise_for_status()
            if route != "reset_prefix_cache" or resp.json().get("success"):
                break
            await asyncio.sleep(0.25)
        else:
            raise E2EError(f"{url}/reset_prefix_cache kept answering success=false ({attempts} tries): requests "
                           f"are still running there; see its log")


def start_mmrag_serve(env: dict[str, str], log_path: Path, timeout_s: float = 600) -> ServerHandle:
    """`mmrag serve` as a child process in its own session, stopped like a replica (SIGINT, then SIGKILL)."""
    port = free_port()
    env = {**env, "MMRAG_HOST": "127.0.0.1", "MMRAG_PORT": str(port)}
    with log_path.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mmrag", "serve"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log_path)
    try:  # uvicorn binds after the lifespan (services + warm-up) has finished
        wait_until_ready(answers_200(f"{handle.url}/readyz", timeout_s=5.0), timeout_s=timeout_s, what="mmrag serve",
                         proc=proc, log=lambda: f"Log {log_path}:\n{handle.log_tail(30)}")
    except ServerStartError as exc:
        handle.stop()
        raise E2EError(str(exc)) from None
    return handle


# --- the run's inputs ----------------------------------------------------------------------------------------

# Builds mmrag's engine (a RemoteEngine at MMRAG_ENGINE_URLS) and pipeline from these MMRAG_* settings, as `mmrag
# serve` would: the composition root (mmrag/bench_cmd.py) passes it, since mmrag/bench/ does not import the wiring.
FloorPipeline = Callable[[dict[str, str]], tuple[Engine, "Pipeline"]]
# Kept from the caller's environment: an emulated ISA's kernel caps must agree with the environment they are in.
KEPT_MMRAG_VARIABLES = ("MMRAG_EMULATE_ISA",)


@dataclass(slots=True)
class E2EInputs:
    model_path: Path
    corpus: BenchCorpus
    spec: E2ESpec
    engine_config: EngineConfig
    root: Path  # this corpus' e2e folder: pages/, mmrag/ (MMRAG_DATA_DIR), llamaindex-qdrant/, logs/
    log: Callable[[str], None]
    floor_pipeline: FloorPipeline

    @property
    def pages_dir(self) -> Path:
        return self.root / "pages"

    @property
    def data_dir(self) -> Path:
        return self.root / "mmrag"

    def env(self) -> dict[str, str]:
        """mmrag's settings for `mmrag ingest` and `mmrag serve` (the engine flags live on the replica): only
        these and mmrag's defaults, whatever MMRAG_* the caller's environment sets (a session's MMRAG_REDIS_URL
        must not take this run's stores, nor its MMRAG_ANSWER_MODE the default's place); the variants change
        some on purpose (:class:`MmragVariant`)."""
        inherited = {k: v for k, v in os.environ.items()
                     if not k.startswith("MMRAG_") or k in KEPT_MMRAG_VARIABLES}
        return {**inherited, "MMRAG_DATA_DIR": str(self.data_dir), "MMRAG_MODEL": str(self.model_path),
                "MMRAG_OCR": "true", "MMRAG_ANSWER_MAX_TOKENS": str(max(self.spec.lengths)),
                "MMRAG_TOP_K": str(self.spec.top_k), "MMRAG_MAX_MODEL_LEN": str(self.engine_config.max_model_len),
                "MMRAG_MAX_IMAGES_PER_PROMPT": str(self.engine_config.max_images_per_prompt),
                "MMRAG_MAX_SUB_QUESTIONS": str(MAX_SUB_QUESTIONS),
                "MMRAG_MAX_QUESTIONS_IN_FLIGHT": str(max(32, self.spec.concurrency)), "MMRAG_API_KEY": "",
                "MMRAG_WARM_TOP": str(WARM_TOP), "MMRAG_ANSWER_MODE": "auto", "MMRAG_DECOMPOSER": "auto",
                # Every question costs what it costs: a question the Zipf draw repeats is not served from the
                # answer cache in the comparison (the repeats run turns it on, apart).
                "MMRAG_ANSWER_CACHE": "false",
                # Every side's answers decode exactly the asked length (make_llm does the same for llama-index):
                # a random-weight model stops wherever it draws an end of sequence. A benchmark knob: read in
                # the development profile only (MMRAG_MODEL is set, so the profile changes nothing else).
                "MMRAG_ANSWER_FIXED_LENGTH": "true", "MMRAG_PROFILE": "development",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(slots=True)
class Shared:
    """What every run reuses: the questions, the replica, and how to tell a cited file's page index."""

    questions: list[E2EQuestion]
    replica_url: str
    client: httpx.AsyncClient  # control traffic: metrics and cache resets
    page_of_doc: dict[str, int]


def ingest(inputs: E2EInputs) -> list[PagePayload]:
    """`mmrag ingest` of the corpus pages (one PNG per distinct page; unchanged files are skipped on a rerun),
    then the indexed pages read back: their OCR text is what the llama-index side indexes too."""
    inputs.pages_dir.mkdir(parents=True, exist_ok=True)
    for page in inputs.corpus.pages:
        target = inputs.pages_dir / page.file
        if not target.is_file():
            shutil.copyfile(inputs.corpus.root / page.file, target)
    log_path = inputs.root / "logs" / "ingest.log"
    with log_path.open("ab") as log:
        rc = subprocess.run([sys.executable, "-m", "mmrag", "ingest", "--json", str(inputs.pages_dir)],
                            env=inputs.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        raise E2EError(f"mmrag ingest failed (exit code {rc}); see {log_path}")
    from mmrag.adapters.qdrant import PageIndex, open_qdrant
    from mmrag.core.settings import Settings

    settings = Settings.of_variables(inputs.env())  # where `mmrag ingest` wrote, whatever MMRAG_* this process has
    storage = settings.storage
    index = PageIndex(open_qdrant("", storage.qdrant_path), storage.qdrant_collection, text_dim=0, image_dim=0)
    try:
        pages = index.pages()
    finally:
        index.client.close()
    if len(pages) != len(inputs.corpus.pages):
        raise E2EError(f"mmrag's index holds {len(pages)} pages, expected {len(inputs.corpus.pages)}; "
                       f"delete {inputs.root} and run again")
    return pages


# --- mmrag over streaming /v1/ask ------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class MmragVariant:
    side: str
    env: dict[str, str] = field(default_factory=dict)  # beside E2EInputs.env()
    request: dict[str, Any] = field(default_factory=dict)  # beside question, stream and max_tokens

    @property
    def answer_cache(self) -> bool:
        return self.env.get("MMRAG_ANSWER_CACHE") == "true"


def variants(stand_in_tokens: int) -> dict[str, MmragVariant]:
    """mmrag's runs by side (module docstring), and the repeats run's."""
    return {MMRAG: MmragVariant(MMRAG),
            MMRAG_SPLIT: MmragVariant(MMRAG_SPLIT, request={"answer_mode": "split"}),
            MMRAG_JOINT: MmragVariant(MMRAG_JOINT, request={"answer_mode": "joint"}),
            MMRAG_MODEL_DECOMPOSER: MmragVariant(MMRAG_MODEL_DECOMPOSER, env={
                "MMRAG_DECOMPOSER": "model", "MMRAG_DECOMPOSE_FIXED_TOKENS": str(stand_in_tokens)}),
            REPEATS: MmragVariant(REPEATS, env={"MMRAG_ANSWER_CACHE": "true"})}


async def ask_streamed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[dict, float | None]:
    """POST /v1/ask with ``"stream": true``: the final answer (the ``done`` event's) and the ``perf_counter`` time
    of its first generated text (:func:`first_generated`; None if none came)."""
    tokens: list[tuple[float, str]] = []
    answer = None
    async with client.stream("POST", f"{url}/v1/ask", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise E2EError(f"mmrag serve answered {resp.status_code} to {body['question']!r}: {resp.text[:400]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue  # the event line repeats the data's "event"; blank lines end an event
            event = json.loads(line[len("data: "):])
            if event["event"] == "token":
                tokens.append((time.perf_counter(), event["text"]))
            elif event["event"] == "error":
                raise E2EError(f"mmrag serve's stream ended in an error for {body['question']!r}: {event}")
            elif event["event"] == "done":
                answer = event["answer"]
    if answer is None:
        raise E2EError(f"mmrag serve's stream for {body['question']!r} ended without its `done` event")
    return answer, first_generated(tokens, answer)


def first_generated(tokens: Sequence[tuple[float, str]], answer: dict) -> float | None:
    """The time of the first ``token`` event that carries generated text: past an answer in parts' first heading
    (a split's, or a joint answer's over several pages: its first part's page label and a colon), which the
    pipeline streams before any part has generated anything (rag/pipeline.py), so it is no token of the
    model's. None when no generated text came."""
    lead = ""
    if answer.get("image_answers"):
        lead = f"{answer['image_answers'][0]['page']}: "
        if not answer["answer"].startswith(lead):
            raise E2EError(f"an answer in parts no longer starts with its first part's heading {lead!r} "
                           f"({answer['answer'][:80]!r}): update mmrag/bench/e2e.first_generated to the heading rag/plans."
                           "part_heading writes")
    seen = 0
    for t, text in tokens:
        seen += len(text)
        if seen > len(lead):
            return t
    return None


def answer_completions(answer: dict) -> int:
    """Engine requests an answer made (its usage covers them): one per part of an answer in parts (a split's, or
    a joint answer's over several pages), a one-prompt answer's one, or joint's overflow's sub-answers and, when
    there are several, their synthesis; none when no page was found or the answer came from the answer cache."""
    if not answer["citations"] or answer["usage"].get("answer_cache") == "hit":
        return 0
    if answer.get("image_answers"):
        return len(answer["image_answers"])
    subs = len(answer.get("sub_answers") or [])
    return subs + (subs > 1) if subs else 1


def _check_contract(answer: dict, question: str, length: int, variant: MmragVariant) -> None:
    """The request fields and settings this bench relies on were honoured: a server that ignores them would be
    measured at another length, strategy or cache setting without saying so."""
    mode = answer.get("answer_mode")
    if answer["citations"] and (mode not in ("split", "joint") or not answer.get("answer_mode_reason")):
        raise E2EError(f"mmrag serve's answer to {question!r} has answer_mode={mode!r}, answer_mode_reason="
                       f"{answer.get('answer_mode_reason')!r}: this checkout's server predates the split and joint "
                       "strategies (issue 40)")
    wanted = variant.request.get("answer_mode")
    if answer["citations"] and wanted not in (None, "auto") and mode != wanted:
        # a split over one page is one prompt: the joint one (rag/plans.choose_answer)
        if not (wanted == "split" and mode == "joint" and len(answer["citations"]) == 1):
            raise E2EError(f"asked answer_mode={wanted}, mmrag serve answered {question!r} with {mode}")
    cache = answer["usage"].get("answer_cache")
    if variant.answer_cache and cache not in ("hit", "miss"):
        raise E2EError(f"the repeats run's answer to {question!r} says answer_cache={cache!r}, not hit or miss: this "
                       "checkout's server predates the answer cache (issue 40), or MMRAG_ANSWER_CACHE=true was not "
                       "honoured")
    if not variant.answer_cache and cache not in (None, "off"):
        raise E2EError(f"mmrag serve answered {question!r} with answer_cache={cache!r} under MMRAG_ANSWER_CACHE="
                       "false: the comparison would count cache hits")
    if cache != "hit" and answer["usage"]["completion_tokens"] > length * max(1, answer_completions(answer)):
        raise E2EError(f"asked max_tokens={length}, mmrag serve generated {answer['usage']['completion_tokens']} "
                       f"tokens for {question!r}: it ignores the request's max_tokens")


@dataclass(slots=True)
class MmragRun:
    """One `mmrag serve` run's outcomes and counters (before and after: the replica's, then the app's)."""

    outcomes: list[Outcome]
    wall_s: float
    before: tuple[dict, dict]
    after: tuple[dict, dict]
    start_s: float


async def serve_and_ask(inputs: E2EInputs, shared: Shared, length: int, variant: MmragVariant,
                        questions: Sequence[E2EQuestion], log_name: str) -> MmragRun:
    """A fresh `mmrag serve` on the reset replica (it warms it at start-up), ``questions`` in a closed loop,
    then it is stopped."""
    await reset_caches(shared.client, shared.replica_url)
    log_path = inputs.root / "logs" / f"mmrag-serve-{log_name}.log"
    t = time.perf_counter()
    server = start_mmrag_serve({**inputs.env(), "MMRAG_ENGINE_URLS": shared.replica_url, **variant.env}, log_path)
    start_s = time.perf_counter() - t
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:

            async def ask(q: E2EQuestion) -> Outcome:
                t0 = time.perf_counter()
                answer, first = await ask_streamed(client, server.url, {"question": q.text, "max_tokens": length,
                                                                        **variant.request})
                latency = time.perf_counter() - t0
                _check_contract(answer, q.text, length, variant)
                return Outcome(latency, first - t0 if first else None, answer["answer"],
                               tuple(shared.page_of_doc[c["doc"]] for c in answer["citations"]), q.pages, q.kind,
                               {"usage": answer["usage"], "sub_questions": len(answer["sub_questions"]),
                                "source": answer["sub_question_source"], "answer_mode": answer.get("answer_mode"),
                                "answer_mode_reason": answer.get("answer_mode_reason"),
                                "answer_cache": answer["usage"].get("answer_cache", "off"),
                                "completions": answer_completions(answer), "timings": answer.get("timings") or {}})

            before = await scrape(client, shared.replica_url), await scrape(client, server.url)
            outcomes, wall = await closed_loop(questions, inputs.spec.concurrency, ask)
            await asyncio.sleep(DRAIN_WAIT_S)
            after = await scrape(client, shared.replica_url), await scrape(client, server.url)
    finally:
        server.stop()
    return MmragRun(outcomes, wall, before, after, start_s)


async def run_mmrag(inputs: E2EInputs, shared: Shared, length: int, variant: MmragVariant
                    ) -> tuple[dict, list[Outcome]]:
    """One mmrag side at ``length``: its figures and its outcomes."""
    run = await serve_and_ask(inputs, shared, length, variant, shared.questions, f"{variant.side}-{length}")
    return {**summarize(run.outcomes, run.wall_s), **mmrag_breakdown(run.outcomes, run.before, run.after),
            "serve_start_s": round(run.start_s, 1), "warm_top": WARM_TOP, "settings": variant.env,
            "request": variant.request, "sample_answer": _sample(run.outcomes[0])}, run.outcomes


async def run_repeats(inputs: E2EInputs, shared: Shared, length: int, variant: MmragVariant) -> dict:
    """The repeats run (module docstring): the answer cache on, its store emptied (an earlier run's answers,
    kept on disk under the data folder, would all be hits), a Zipf stream over the question set."""
    shutil.rmtree(inputs.data_dir / "answers", ignore_errors=True)  # the disk store (mmrag/adapters/answer_store.py)
    stream = [shared.questions[i] for i in repeat_stream(len(shared.questions), inputs.spec)]
    run = await serve_and_ask(inputs, shared, length, variant, stream, f"{REPEATS}-{length}")
    engine = delta(run.before[0], run.after[0], _VLLM + _VLLM_COUNTERS)
    return {**repeats_summary(run.outcomes, run.wall_s), "length": length, "distinct_questions": len(set(stream)),
            "zipf_s": inputs.spec.zipf_s, "concurrency": inputs.spec.concurrency, "settings": variant.env,
            "engine_requests_per_ask": round(engine["vllm:request_success_total"] / len(stream), 3),
            "generation_tokens_per_ask": round(engine["vllm:generation_tokens_total"] / len(stream), 1)}


def repeats_summary(outcomes: Sequence[Outcome], wall_s: float) -> dict:
    """The repeats run's figures: questions/s (wall clock), the answer cache's hit rate (each answer's
    ``usage.answer_cache``), the client's latency p50/p99 of hits and of misses (on loopback), and a hit's time
    at the server: the answer's stage ``timings`` summed (the pipeline's decomposition, retrieval, lookup and
    replay, HTTP not included), the figure the target reads when every hit has it."""
    hits = [o for o in outcomes if o.extra["answer_cache"] == "hit"]
    misses = [o for o in outcomes if o.extra["answer_cache"] != "hit"]
    server = [sum(v for v in o.extra["timings"].values() if isinstance(v, (int, float))) for o in hits
              if o.extra["timings"]]
    at_server = bool(hits) and len(server) == len(hits)
    hit_client = _percentiles("hit_latency", [o.latency_s for o in hits])
    hit_server = _percentiles("hit_server", server)
    return {"asks": len(outcomes), "wall_s": round(wall_s, 3),
            "questions_per_s": round(len(outcomes) / wall_s, 4) if wall_s else 0.0,
            "answer_cache_hits": len(hits), "answer_cache_misses": len(misses),
            "answer_cache_hit_rate": round(len(hits) / len(outcomes), 4) if outcomes else 0.0,
            # the engine requests its answers say they made (a hit: none), to set beside the replica's count
            "answer_completions_per_ask": round(sum(o.extra["completions"] for o in outcomes) / len(outcomes), 3)
            if outcomes else 0.0,
            **hit_client, **_percentiles("miss_latency", [o.latency_s for o in misses]), **hit_server,
            "hit_p50_s": hit_server["hit_server_p50_s"] if at_server else hit_client["hit_latency_p50_s"],
            "hit_p50_measured_at": "server" if at_server else "client (loopback)",
            "ttft_p50_s": _percentiles("ttft", [o.ttft_s for o in outcomes if o.ttft_s is not None])["ttft_p50_s"]}


STAGES = ("decompose_s", "retrieve_s", "answer_s", "sub_answers_s", "synthesis_s")


def mmrag_breakdown(outcomes: Sequence[Outcome], before: tuple[dict, dict], after: tuple[dict, dict]) -> dict:
    """Where mmrag's time goes, per question: engine seconds by phase (the replica's histograms, every
    request), the scheduler's queue wait, and decomposition's share. MeteredEngine counts every completion
    and the answers' usage covers the answer's requests only, so decomposition is the difference; its decode
    seconds are estimated from its share of the generated tokens (vLLM does not label requests)."""
    n = len(outcomes)
    engine = delta(before[0], after[0], _VLLM + _VLLM_COUNTERS)
    app = delta(before[1], after[1], _MMRAG + _MMRAG_COUNTERS)
    usage = [o.extra["usage"] for o in outcomes]
    answered = sum(o.extra["completions"] for o in outcomes)
    decompose = {
        "requests": app["mmrag_engine_requests_total"] - answered,
        "prompt_tokens": app["mmrag_prompt_tokens_total"] - sum(u["prompt_tokens"] for u in usage),
        "generated_tokens": app["mmrag_completion_tokens_total"] - sum(u["completion_tokens"] for u in usage),
        "ttft_s": app["mmrag_ttft_seconds_sum"] - sum(u["ttft_s"] for u in usage),
    }
    generated = engine["vllm:generation_tokens_total"]
    decode_share = decompose["generated_tokens"] / generated if generated else 0.0
    ttft = [u["ttft_s"] / o.extra["completions"] for u, o in zip(usage, outcomes) if o.extra["completions"]]
    return {
        **engine_breakdown(engine, n),
        "scheduler_queue_s": round(app["mmrag_queue_wait_seconds_sum"] / n, 4),
        "scheduler_plans_per_question": round(app["mmrag_queue_wait_seconds_count"] / n, 3),
        **{f"decompose_{k}_per_question": round(v / n, 4) or 0.0 for k, v in decompose.items()},  # not -0.0
        "decompose_decode_s_estimated": round(decode_share * engine["vllm:request_decode_time_seconds_sum"] / n, 4),
        # a split's parts, joint's one prompt, or its overflow's sub-answers + synthesis
        "answer_completions_per_question": round(answered / n, 3),
        **_percentiles("engine_ttft", ttft),  # per engine request of an answer, from its dispatch
        "answer_modes": _counts(o.extra["answer_mode"] or "none" for o in outcomes),
        "sub_question_sources": _counts(o.extra["source"] for o in outcomes),
        "decomposed_as_designed": round(sum(o.extra["sub_questions"] == len(o.asked) for o in outcomes) / n, 3),
        # The answers' own wall time per stage (rag/pipeline.py), mean per question; a stage that did not run
        # for a question counts 0 there.
        "stage_s": {stage: round(sum(o.extra["timings"].get(stage) or 0.0 for o in outcomes) / n, 4)
                    for stage in STAGES},
    }


# --- the floor: mmrag's own plans with every image already in KV ---------------------------------------------


@dataclass(slots=True, frozen=True)
class FloorQuestion:
    """One question's plans as the default strategy submits them, and the pages its answer cites."""

    plans: tuple[PromptPlan, ...]  # run at once: a split's parts, the joint prompt, or an overflow's sub-answers
    synthesis: PromptPlan | None  # joint's overflow: the text-only plan over their answers, run after them
    cited: tuple[int, ...]

    @property
    def streamed(self) -> PromptPlan:
        """The plan whose first token is the answer's first (what the pipeline streams first)."""
        return self.synthesis or self.plans[0]

    @property
    def all_plans(self) -> tuple[PromptPlan, ...]:
        return self.plans + ((self.synthesis,) if self.synthesis is not None else ())


def floor_question(plans: Sequence[PromptPlan], cited: tuple[int, ...], question: str) -> FloorQuestion:
    """The plans one answer submitted, in order: the ones that show pages run at once; a text-only plan (no
    image: joint's overflow synthesis over the sub-answers) comes last and runs after them."""
    shown = tuple(p for p in plans if p.images)
    text_only = [p for p in plans if not p.images]
    if not shown or len(text_only) > 1 or (text_only and plans[-1] is not text_only[0]):
        raise E2EError(f"mmrag's answer to {question!r} submitted {len(shown)} plans with images and "
                       f"{len(text_only)} without, the last {'with' if plans and plans[-1].images else 'without'}: "
                       "the floor knows a split's parts, the joint prompt, and joint's overflow (sub-answers, then "
                       "one synthesis)")
    return FloorQuestion(shown, text_only[0] if text_only else None, cited)


async def record_plans(pipe: Pipeline, questions: Sequence[E2EQuestion], length: int,
                       page_of_doc: dict[str, int]) -> list[FloorQuestion]:
    """Each question's plans as mmrag's pipeline makes them with its default strategy (its ``submit`` records
    every plan and answers nothing, so a synthesis reads empty sub-answers), with the pages it cites."""
    plans: list[PromptPlan] = []

    async def record(plan: PromptPlan, *, on_text=None) -> Completion:
        plans.append(plan)
        return Completion(text="", token_ids=[], usage=Usage(), model="")

    pipe.submit = record
    out = []
    for q in questions:  # in order, as the closed loop starts them: what the pipeline learns, it learns the same way
        plans.clear()
        answer = await pipe.ask(q.text, max_tokens=length)
        out.append(floor_question(list(plans), tuple(page_of_doc[c.doc] for c in answer.citations), q.text))
    return out


def floor_batches(costs: Sequence[Sequence[tuple[PromptPlan, int]]], budget: int) -> list[list[int]]:
    """Consecutive questions (``costs[i]``: question i's plans and their KV tokens), grouped so each group's
    distinct plans (a plan asked twice is cached once) cost at most ``budget`` KV tokens together; a question over
    the budget alone is a group of its own."""
    batches: list[list[int]] = []
    seen: set[PromptPlan] = set()
    used = 0
    for i, plans in enumerate(costs):
        mine = dict(plans)  # a question's own repeated plan counts once
        extra = sum(cost for plan, cost in mine.items() if plan not in seen)
        if not batches or used + extra > budget:
            batches.append([])
            seen, used, extra = set(), 0, sum(mine.values())
        batches[-1].append(i)
        seen.update(mine)
        used += extra
    return batches


def _images_only(plan: PromptPlan) -> PromptPlan:
    """The plan's system prompt and images without its text, generating one token: their KV stays in the cache
    for the timed run of the plan, which computes its text (plans that differ only in text fill it once)."""
    return replace(plan, text="", sampling=replace(plan.sampling, max_tokens=1, min_tokens=0))


async def run_floor(inputs: E2EInputs, shared: Shared, length: int) -> tuple[dict, list[Outcome]]:
    """The floor at ``length``: after mmrag's run (its server stopped, so its Qdrant folder is free)."""
    env = {**inputs.env(), "MMRAG_ENGINE_URLS": shared.replica_url}
    engine, pipe = inputs.floor_pipeline(env)
    try:
        recorded = await record_plans(pipe, shared.questions, length, shared.page_of_doc)
        costs = [[(plan, pipe.token_counts.of_plan(plan) + FLOOR_TEXT_TOKENS) for plan in fq.all_plans]
                 for fq in recorded]
        capacity = await engine.kv_capacity()
        batches = floor_batches(costs, capacity.tokens // 2)
        await reset_caches(shared.client, shared.replica_url)
        outcomes: list[Outcome] = []
        engine_delta: dict[str, float] = {}
        wall = fill_s = 0.0

        async def ask(i: int) -> Outcome:
            fq, q = recorded[i], shared.questions[i]
            t0 = time.perf_counter()
            first: list[float] = []

            def generate(plan: PromptPlan) -> Awaitable[Completion]:
                timed = plan is fq.streamed
                return engine.generate(plan, on_first_token=(lambda: first.append(time.perf_counter()))
                                       if timed else None)

            completions = await asyncio.gather(*(generate(p) for p in fq.plans))
            text = "".join(c.text for c in completions)
            if fq.synthesis is not None:
                text = (await generate(fq.synthesis)).text
            return Outcome(time.perf_counter() - t0, first[0] - t0 if first else None, text, fq.cited, q.pages,
                           q.kind, {"plans": len(fq.all_plans)})

        for batch in batches:
            t = time.perf_counter()
            distinct = list(dict.fromkeys(_images_only(p) for i in batch for p in recorded[i].all_plans))
            await asyncio.gather(*(engine.generate(p) for p in distinct))
            fill_s += time.perf_counter() - t
            before = await scrape(shared.client, shared.replica_url)
            done, batch_wall = await closed_loop(batch, inputs.spec.concurrency, ask)
            after = await scrape(shared.client, shared.replica_url)
            outcomes += done
            wall += batch_wall
            for k, v in delta(before, after, _VLLM + _VLLM_COUNTERS).items():
                engine_delta[k] = engine_delta.get(k, 0.0) + v
    finally:
        await engine.close()
        await pipe.searcher.client.close()
    plans = [p for fq in recorded for p in fq.all_plans]
    return {**summarize(outcomes, wall), **engine_breakdown(engine_delta, len(outcomes)),
            "batches": len(batches), "kv_budget_tokens": capacity.tokens // 2, "prefill_untimed_s": round(fill_s, 1),
            "plans_per_question": round(len(plans) / len(recorded), 3),
            "images_per_plan_mean": round(sum(len(p.images) for p in plans) / len(plans), 2),
            "sample_answer": _sample(outcomes[0])}, outcomes


# --- the llama-index peers, as its documentation builds them -------------------------------------------------


class LlamaIndexEmbedding(BaseEmbedding):
    """mmrag's text embedder (all-MiniLM-L6-v2 from site-packages, no hub) as a llama-index embed model, the
    documented custom-embedding way; the query embedding runs in a thread, as mmrag's searcher does."""

    _embedder: Any = PrivateAttr()

    def __init__(self, embedder: TextEmbedder) -> None:
        super().__init__(model_name=embedder.name, embed_batch_size=embedder.batch_size)
        self._embedder = embedder

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embedder.embed([query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return (await asyncio.to_thread(self._embedder.embed, [query]))[0].tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embedder.embed(texts).tolist()


def build_index(pages: Sequence[PagePayload], path: Path, collection: str, embed_model: BaseEmbedding) -> None:
    """A fresh Qdrant collection (local mode at ``path``) with one ``ImageNode`` per page: its text (what is
    embedded), its image file (what the multimodal synthesizer shows), and the file metadata llama-index's
    readers set (``file_path``, ``file_name``, ``page_label``)."""
    from qdrant_client import QdrantClient

    shutil.rmtree(path, ignore_errors=True)
    client = QdrantClient(path=str(path))
    try:
        store = QdrantVectorStore(collection_name=collection, client=client)
        nodes = [ImageNode(id_=p.page_id, text=p.text, image_path=p.path, image_mimetype="image/png",
                           metadata={"file_path": p.path, "file_name": p.doc, "page_label": str(p.page)})
                 for p in pages]
        VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store),
                         embed_model=embed_model)
    finally:
        client.close()


def make_retriever(aclient: Any, collection: str, embed_model: BaseEmbedding, top_k: int) -> BaseRetriever:
    store = QdrantVectorStore(collection_name=collection, aclient=aclient)
    return VectorStoreIndex.from_vector_store(store, embed_model=embed_model).as_retriever(similarity_top_k=top_k)


def llamaindex_context_window(config: EngineConfig, top_k: int) -> int:
    """The replica's context plus llama-index's per-image estimate for every retrieved page: room for its
    compact synthesizer to pack them into one call (module docstring); the real prompts stay within the
    replica's own (the replica would refuse one that did not)."""
    return config.max_model_len + top_k * LLAMAINDEX_IMAGE_TOKENS


def served_name(model_path: Path) -> str:
    """The name a replica serves the checkpoint at ``model_path`` under, wherever its folder is: its fingerprint's
    (serving/vllm_launch.serve_command gives every replica that name beside its path), so a replica started on
    the same files from another folder (a link to them, say) answers to it too."""
    return fingerprint_name(checkpoint_fingerprint(model_path))


def make_llm(url: str, model_name: str, max_tokens: int, context_window: int) -> OpenAILike:
    """The replica's OpenAI-compatible API (``model_name``: :func:`served_name`); greedy, no retries (a failure
    must show, not be retried away). Every completion decodes exactly ``max_tokens`` (vLLM's ``min_tokens``, as
    mmrag's MMRAG_ANSWER_FIXED_LENGTH): a random-weight model's answers would otherwise stop at random lengths,
    and no side would answer at the length asked."""
    return OpenAILike(model=model_name, api_base=f"{url}/v1", api_key="unused", is_chat_model=True,
                      context_window=context_window, max_tokens=max_tokens, temperature=0.0, timeout=900.0,
                      max_retries=0, additional_kwargs={"extra_body": {"min_tokens": max_tokens}})


def one_shot_engine(retriever: BaseRetriever, llm: OpenAILike, *, streaming: bool = True) -> RetrieverQueryEngine:
    """llama-index's multimodal RAG query engine: retrieved nodes become content blocks (image included)."""
    return RetrieverQueryEngine.from_args(retriever, llm=llm, multimodal=True, streaming=streaming)


def sub_question_engine(retriever: BaseRetriever, llm: OpenAILike) -> SubQuestionQueryEngine:
    """SubQuestionQueryEngine over one tool, the one-shot engine without streaming (module docstring), mmrag's
    rule decomposition, and a streaming synthesizer for the final answer."""
    tool = QueryEngineTool.from_defaults(one_shot_engine(retriever, llm, streaming=False), name="pages",
                                         description="Figure pages of the ingested documents, as images.")
    return SubQuestionQueryEngine.from_defaults(
        query_engine_tools=[tool], question_gen=MMRAGQuestionGenerator(Decomposer(None, max_n=MAX_SUB_QUESTIONS)),
        llm=llm, use_async=True, verbose=False,  # verbose prints every sub-answer to stdout
        response_synthesizer=get_response_synthesizer(llm=llm, streaming=True, use_async=True))


async def stream_query(engine: BaseQueryEngine, question: str) -> tuple[AsyncStreamingResponse, str, float | None]:
    """``aquery``, its streamed answer read to the end: the response, the text and the ``perf_counter`` time of
    its first non-empty delta (None if none came)."""
    response = await engine.aquery(question)
    if not isinstance(response, AsyncStreamingResponse):
        raise E2EError(f"the llama-index engine answered {type(response).__name__}, not a stream: build its "
                       "synthesizer with streaming=True")
    first, text = None, ""
    async for delta_text in response.async_response_gen():
        if first is None and delta_text:
            first = time.perf_counter()
        text += delta_text
    return response, text, first


async def run_llamaindex(inputs: E2EInputs, shared: Shared, length: int, side: str, retriever: BaseRetriever
                         ) -> tuple[dict, list[Outcome]]:
    llm = make_llm(shared.replica_url, served_name(inputs.model_path), length,
                   llamaindex_context_window(inputs.engine_config, inputs.spec.top_k))
    subq = side == LLAMAINDEX_SUBQ
    engine = sub_question_engine(retriever, llm) if subq else one_shot_engine(retriever, llm)
    rules = RuleDecomposer(max_n=MAX_SUB_QUESTIONS)
    await reset_caches(shared.client, shared.replica_url)

    async def ask(q: E2EQuestion) -> Outcome:
        t0 = time.perf_counter()
        response, text, first = await stream_query(engine, q.text)
        done = time.perf_counter()
        pages = [n for n in response.source_nodes if "file_name" in n.node.metadata]
        extra = {}
        if subq:  # the final synthesis' nodes are the sub-answers: one per sub-question that came back
            answered = len(response.source_nodes) - len(pages)
            wanted = len(rules.split(q.text))
            if answered != wanted:
                raise E2EError(f"llama-index answered {answered} of the {wanted} sub-questions of {q.text!r}: it "
                               "drops a failed one with a logged warning (sub_question_query_engine.py); see above")
            extra["sub_questions"] = answered
        return Outcome(done - t0, first - t0 if first else None, text,
                       tuple(dict.fromkeys(shared.page_of_doc[n.node.metadata["file_name"]] for n in pages)),
                       q.pages, q.kind, extra)

    before = await scrape(shared.client, shared.replica_url)
    outcomes, wall = await closed_loop(shared.questions, inputs.spec.concurrency, ask)
    after = await scrape(shared.client, shared.replica_url)
    out = {**summarize(outcomes, wall), **engine_breakdown(delta(before, after, _VLLM + _VLLM_COUNTERS), len(outcomes)),
           "context_window_told": llm.context_window, "sample_answer": _sample(outcomes[0])}
    if subq:
        out["sub_questions_per_question"] = round(sum(o.extra["sub_questions"] for o in outcomes) / len(outcomes), 3)
    return out, outcomes


# --- targets -----------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _target(name: str, measured: float | None, wanted: str, met: bool, **detail: Any) -> dict:
    return {"name": name, "measured": measured, "wanted": wanted, "met": bool(met), **detail}


def _at_least(name: str, measured: float | None, wanted: float, **detail: Any) -> dict:
    return _target(name, measured, f">= {wanted}", measured is not None and measured >= wanted, **detail)


def _at_most(name: str, measured: float | None, wanted: float, **detail: Any) -> dict:
    return _target(name, measured, f"<= {wanted}", measured is not None and measured <= wanted, **detail)


def targets(by_length: dict[str, dict[str, dict]], by_class: dict[str, dict[str, dict]], repeats: dict,
            reference: int) -> list[dict]:
    """Issue 40's targets, each from this one run: the default (side ``mmrag``) over the llama-index one-shot
    at the reference length overall (wall clock) and per class (estimated, module docstring); no class below
    EVERY_CLASS_AT_LEAST at any length; TTFT, the floor, the joint prompts' prefix hits, the answer cache, the
    generated tokens and the asked pages cited at the reference length."""
    ref, at = by_length[str(reference)], f"at {reference} tokens"
    m, li = ref[MMRAG], ref[LLAMAINDEX]
    classes = by_class[str(reference)][MMRAG]
    out = [_at_least(f"questions/s mmrag / llamaindex {at}", _ratio(m["questions_per_s"], li["questions_per_s"]),
                     QPS_OVER_LLAMAINDEX["overall"])]
    out += [_at_least(f"questions/s mmrag / llamaindex on {kind} questions {at} (estimated per class)",
                      classes.get(kind, {}).get("questions_per_s_over_llamaindex"), QPS_OVER_LLAMAINDEX[kind])
            for kind in CLASSES]
    for length, sides in by_class.items():
        ratios = {kind: s["questions_per_s_over_llamaindex"] for kind, s in sides[MMRAG].items()}
        worst = min(ratios, key=lambda k: ratios[k] if ratios[k] is not None else -1.0)
        out.append(_at_least(f"questions/s mmrag / llamaindex, lowest class at {length} tokens", ratios[worst],
                             EVERY_CLASS_AT_LEAST, worst_class=worst))
    out.append(_at_most(f"TTFT p50 mmrag / llamaindex {at}", _ratio(m["ttft_p50_s"], li["ttft_p50_s"]),
                        TTFT_OVER_LLAMAINDEX["overall"]))
    out.append(_at_most(f"TTFT p50 mmrag / llamaindex on comparison questions {at}",
                        classes.get(COMPARISON, {}).get("ttft_p50_over_llamaindex"), TTFT_OVER_LLAMAINDEX[COMPARISON]))
    joint = ref[MMRAG_JOINT]["prefix_cache_hit_rate"]
    out.append(_at_least(f"prefix-cache hit rate, mmrag_joint minus llamaindex {at}",
                         round(joint - li["prefix_cache_hit_rate"], 4), 0))
    out.append(_at_least(f"questions/s mmrag / floor {at}", _ratio(m["questions_per_s"], ref[FLOOR]["questions_per_s"]),
                         OVER_FLOOR))
    where = repeats["hit_p50_measured_at"]
    out.append(_at_most(f"repeated question from the answer cache, p50 s {at} (at the {where})", repeats["hit_p50_s"],
                        ANSWER_CACHE_HIT_P50_S))
    out.append(_at_most(f"generated tokens per question mmrag / llamaindex {at}",
                        _ratio(m["generation_tokens_per_question"], li["generation_tokens_per_question"]),
                        GENERATED_OVER_LLAMAINDEX))
    out.append(_at_least(f"asked pages cited, mmrag minus llamaindex {at}",
                         round(m["asked_pages_cited"] - li["asked_pages_cited"], 3), 0))
    return out


def decomposition(by_length: dict[str, dict[str, dict]], reference: int, stand_in: dict) -> dict:
    """What decomposing with a model adds per question, at the reference length: the model decomposer's run
    against mmrag's own (the rules, for a random-weight model)."""
    ref = by_length[str(reference)]
    rules, model = ref[MMRAG], ref[MMRAG_MODEL_DECOMPOSER]
    keys = ("decompose_requests_per_question", "decompose_prompt_tokens_per_question",
            "decompose_generated_tokens_per_question", "decompose_ttft_s_per_question", "decompose_decode_s_estimated")
    return {"stand_in": stand_in, "length": reference,
            "rules": {k: rules[k] for k in keys} | {"decompose_s": rules["stage_s"]["decompose_s"]},
            "model": {k: model[k] for k in keys} | {"decompose_s": model["stage_s"]["decompose_s"]},
            "adds_latency_p50_s": round(model["latency_p50_s"] - rules["latency_p50_s"], 4),
            "questions_per_s_ratio": _ratio(model["questions_per_s"], rules["questions_per_s"])}


# --- progress ----------------------------------------------------------------------------------------------

SERVE_START_S = 30.0  # a fresh `mmrag serve` (embedder, tokenizer, warm-up of the replica): a first guess


@dataclass(slots=True)
class Progress:
    """A line per run's start and end, with the elapsed time and what is left. The estimate is decode steps
    (each side's sequential answer tokens per question, ``concurrency`` questions at a time) times the
    replica's measured step, plus a request's fixed cost and server starts; as runs finish it is scaled by
    what they took against what was estimated for them."""

    log: Callable[[str], None]
    estimates: dict[tuple[str, int], float]
    started: float = field(default_factory=time.perf_counter)
    estimated_done: float = 0.0
    actual_done: float = 0.0
    _run_started: float = 0.0

    def total_estimate_s(self) -> float:
        return sum(self.estimates.values())

    def start(self, side: str, length: int) -> None:
        self._run_started = time.perf_counter()
        self.log(f"e2e [{self.elapsed():.0f} s] {side} at {length} tokens: start")

    def end(self, side: str, length: int, result: dict) -> None:
        took = time.perf_counter() - self._run_started
        self.estimated_done += self.estimates.pop((side, length))
        self.actual_done += took
        scale = self.actual_done / self.estimated_done if self.estimated_done else 1.0
        self.log(f"e2e [{self.elapsed():.0f} s] {side} at {length} tokens: {result['questions_per_s']:.3f} "
                 f"questions/s, done in {took:.0f} s; about {self.total_estimate_s() * scale:.0f} s left")

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def estimate_runs(spec: E2ESpec, step_s: float, request_s: float, stand_in_tokens: int, repeat_misses: int
                  ) -> dict[tuple[str, int], float]:
    """Seconds per (side, length) and for the repeats run, before anything ran: see :class:`Progress`.
    ``repeat_misses``: the repeats stream's distinct questions, each answered once (the rest are hits)."""
    rounds = -(-spec.questions // spec.concurrency)  # closed loop: questions / concurrency at a time
    subs = 3  # a compound question's 2-3 clauses, each a sub-question
    out = {}
    for length in spec.lengths:
        chains = {MMRAG: (length, 1), MMRAG_SPLIT: (-(-length // 2), 1), MMRAG_JOINT: (length, 1),
                  MMRAG_MODEL_DECOMPOSER: (stand_in_tokens + length, 2), FLOOR: (length, 1),
                  LLAMAINDEX: (length, 1), LLAMAINDEX_SUBQ: (2 * length, subs + 1)}
        for side in spec.sides_at(length):
            tokens, requests = chains[side]
            start = SERVE_START_S if side.startswith(MMRAG) else 0.0
            out[(side, length)] = start + rounds * (tokens * step_s + requests * request_s)
    ref = spec.reference_length
    out[(REPEATS, ref)] = SERVE_START_S + -(-repeat_misses // spec.concurrency) * (ref * step_s + request_s)
    return out


async def measure_step(client: httpx.AsyncClient, url: str, model: str, concurrency: int) -> tuple[float, float]:
    """The replica's (decode step, short request) seconds with ``concurrency`` text-only requests at once, as the
    closed loop keeps them: a round of 1 token, then one of 33."""

    async def one(tokens: int) -> None:
        resp = await client.post(f"{url}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Count from one to one hundred."}],
            "max_tokens": tokens, "min_tokens": tokens, "temperature": 0.0})
        resp.raise_for_status()

    async def timed(tokens: int) -> float:
        t = time.perf_counter()
        await asyncio.gather(*(one(tokens) for _ in range(concurrency)))
        return time.perf_counter() - t

    short = await timed(1)
    return max(0.0, (await timed(33) - short) / 32), short


# --- the run -----------------------------------------------------------------------------------------------


async def run_e2e(inputs: E2EInputs) -> dict:
    """Ingest, one replica, then every length's sides one after the other and the repeats run; the JSON
    section ``e2e``."""
    from qdrant_client import AsyncQdrantClient

    from mmrag.adapters.embed import TextEmbedder

    spec = inputs.spec
    logs = inputs.root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    questions = make_questions(inputs.corpus, spec)
    stand_in = decompose_stand_in(questions)
    repeat_misses = len(set(repeat_stream(len(questions), spec)))
    t = time.perf_counter()
    pages = ingest(inputs)
    ingest_s = time.perf_counter() - t
    qdrant_path = inputs.root / "llamaindex-qdrant"
    embed = LlamaIndexEmbedding(TextEmbedder())
    build_index(pages, qdrant_path, LLAMAINDEX_COLLECTION, embed)
    inputs.log(f"e2e: {len(pages)} pages ingested ({ingest_s:.0f} s); {len(questions)} questions "
               f"({', '.join(f'{n} {k}' for k, n in _counts(q.kind for q in questions).items())}), concurrency "
               f"{spec.concurrency}, answer lengths {', '.join(map(str, spec.lengths))} (variants and {spec.asks} "
               f"repeated asks at {spec.reference_length}); model decomposer stand-in {stand_in['fixed_tokens']} "
               "tokens")
    t = time.perf_counter()
    replica = start_replica(inputs.model_path, inputs.engine_config, logs / "vllm.log", port=free_port())
    replica_start_s = time.perf_counter() - t
    aclient = AsyncQdrantClient(path=str(qdrant_path))
    by_length: dict[str, dict[str, dict]] = {}
    outcomes: dict[str, dict[str, list[Outcome]]] = {}
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            shared = Shared(questions, replica.url, client, {p.file: p.index for p in inputs.corpus.pages})
            step_s, request_s = await measure_step(client, replica.url, served_name(inputs.model_path),
                                                   spec.concurrency)
            progress = Progress(inputs.log, estimate_runs(spec, step_s, request_s, stand_in["fixed_tokens"],
                                                          repeat_misses))
            estimated_s = progress.total_estimate_s()
            inputs.log(f"e2e: replica {replica.url} ready in {replica_start_s:.0f} s (decode step {step_s * 1e3:.0f} "
                       f"ms); the runs should take about {progress.total_estimate_s() / 60:.0f} min")
            retriever = make_retriever(aclient, LLAMAINDEX_COLLECTION, embed, spec.top_k)
            mmrag_runs = variants(stand_in["fixed_tokens"])
            for length in spec.lengths:
                results: dict[str, dict] = {}
                outcomes[str(length)] = {}
                for side in spec.sides_at(length):
                    progress.start(side, length)
                    if side in mmrag_runs:
                        run = run_mmrag(inputs, shared, length, mmrag_runs[side])
                    elif side == FLOOR:
                        run = run_floor(inputs, shared, length)
                    else:
                        run = run_llamaindex(inputs, shared, length, side, retriever)
                    results[side], outcomes[str(length)][side] = await run
                    progress.end(side, length, results[side])
                by_length[str(length)] = results
            progress.start(REPEATS, spec.reference_length)
            repeats = await run_repeats(inputs, shared, spec.reference_length, mmrag_runs[REPEATS])
            progress.end(REPEATS, spec.reference_length, repeats)
    finally:
        await aclient.close()
        replica.stop()
    by_class = class_report(outcomes, spec.concurrency)
    return {
        "spec": asdict(spec) | {"reference_length": spec.reference_length, "asks": spec.asks},
        "engine": asdict(inputs.engine_config),
        "ingest_s": round(ingest_s, 1), "replica": {"shared_by_every_side": True, "start_s": round(replica_start_s, 1),
                                                    "decode_step_s": round(step_s, 4), "resets": list(RESETS)},
        "question_set": {"classes": [q.kind for q in questions], "class_counts": _counts(q.kind for q in questions),
                         "designed_sub_questions": [len(q.pages) for q in questions],
                         "texts": [q.text for q in questions]},
        "runs_s": {"estimated": round(estimated_s), "took": round(progress.elapsed())},
        "by_length": by_length,
        "by_class": by_class,
        "auto_choices": {length: {side: auto_choices(outcomes[length][side]) for side in AUTO_SIDES if side in sides}
                         for length, sides in outcomes.items()},
        "repeats": repeats,
        "notes": {"by_class_questions_per_s": QPS_BY_CLASS_HOW,
                  "ttft": "the first generated text the client sees (a split answer's first heading, streamed before "
                          "anything is generated, is not counted)"},
        "decomposition": decomposition(by_length, spec.reference_length, stand_in),
        "targets": targets(by_length, by_class, repeats, spec.reference_length),
    }
