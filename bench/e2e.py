"""`mmrag bench --e2e`: what a user feels, through each public interface, on one `vllm serve` replica (issue 22).

The same compound questions (:func:`make_questions`), the same pages and the same engine flags for every side,
at each answer length of ``E2ESpec.lengths`` (4, 128 and 512 tokens in the full run; ``--max-tokens N`` runs N
only), greedy, a closed loop of ``concurrency`` questions in flight, every answer read as a stream:

- **mmrag**: `mmrag serve` as a child process (MMRAG_ENGINE_URLS at the replica, MMRAG_ANSWER_MAX_TOKENS the
  longest length), asked over `POST /v1/ask` with ``"stream": true`` and the length as ``max_tokens``; its
  default answer mode (auto). TTFT is the first ``token`` event. It warms the replica at start-up as it does by
  default (MMRAG_WARM_TOP=-1), before the clock: a fresh process per run, since the page-popularity order it
  learns is per process, so every length starts warm and equal.
- **mmrag_every_page**, **mmrag_per_image**, **mmrag_per_sub_question**, **mmrag_model_decomposer** (at the
  reference length only, below): the same with MMRAG_ONE_PROMPT_PAGES=0 (the one prompt shows every retrieved
  page, not the default budget: the other candidate), with the request's ``answer_mode`` "per_image" (each of
  the one prompt's pages leads a prompt of its own, the length shared, the parts joined), with "per_sub_question"
  (a prompt per sub-question, then a synthesis), and with
  MMRAG_DECOMPOSER=model, MMRAG_DECOMPOSE_FIXED_TOKENS=N: the model decodes exactly N tokens per question, a
  stand-in for a real model's decomposition (:func:`decompose_stand_in` says how N is computed; a random-weight
  model's reply is then rejected and the rules split, so sub-questions stay the same).
- **floor**: one request per question with every image already in KV. mmrag's own one-prompt plans at that
  length (its pipeline, built in this process over mmrag's index by the caller's ``floor_pipeline``, with a
  recording ``submit``), then, in batches whose distinct prompts fit half the KV cache, each batch's plans
  prefilled untimed and run timed through the same remote engine, a closed loop of the same concurrency.
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

**One replica** serves every side and length, started once with ``VLLM_SERVER_DEV_MODE=1`` and
``max_images_per_prompt`` 12 (mmrag's one prompt shows the union of its 2-3 sub-questions' top-3 pages); before
every run its prefix, multimodal-processor and encoder caches are reset (``POST /reset_prefix_cache``,
``/reset_mm_cache``, ``/reset_encoder_cache``), so each starts from the same cold state. One replica rather than
one per side: the flags are identical by construction, start-up (the model load) is paid once, and the sides run
one after the other anyway; the counters are read as before/after differences.

**The reference length** is 128 tokens when it is among the lengths, else the first length asked: the two mmrag
variants run there, and the targets that name one length are checked there (a one-length run, such as the smoke
test's ``--max-tokens 8``, runs and checks everything at that length).

Per side and length: questions/s, latency and TTFT p50/p99 (client side), and from the replica's Prometheus
counters before and after (:func:`engine_breakdown`) engine requests, prompt and generated tokens per question
and the prefix-cache hit rate; the asked pages cited (:func:`summarize`). For mmrag also where its time goes
(:func:`mmrag_breakdown`): its answers' stage timings and, from its own counters, what decomposition sends.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
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

from bench.corpus import BenchCorpus
from bench.workload import zipf_probabilities
from core.engine import Completion, Engine, PromptPlan, Usage
from core.settings import Settings
from devkit.ports import free_port
from rag.decompose import Decomposer, MMRAGQuestionGenerator, RuleDecomposer
from serving.engine.config import EngineConfig
from serving.readiness import ServerStartError, answers_200, wait_until_ready
from serving.vllm_launch import DEV_MODE, ServerHandle, start_dev_replica as start_replica

if TYPE_CHECKING:
    from adapters.embed import TextEmbedder
    from core.payload import PagePayload
    from rag.pipeline import Pipeline

_ASKS = (
    "what is the trend of {what} in Figure {n}",
    "which quarter peaks for {what} in Figure {n}",
    "how large is the change in {what} in Figure {n}",
    "what does Figure {n} show about {what}",
)
LENGTHS = (4, 128, 512)  # answer tokens of the full run
REFERENCE_LENGTH = 128
MAX_IMAGES_PER_PROMPT = 12  # the union of up to 4 sub-questions' top-3 pages in one prompt
LLAMAINDEX_COLLECTION = "bench_pages"
LLAMAINDEX_IMAGE_TOKENS = 2125  # what llama-index counts per image (ImageBlock.aestimate_tokens)
WARM_TOP = -1  # `mmrag serve`'s default: warm every page that fits before the first question
MAX_SUB_QUESTIONS = 4  # mmrag's MMRAG_MAX_SUB_QUESTIONS default; the llama-index peer splits with the same rules
CHARS_PER_TOKEN = 4  # Qwen's tokenizer on English JSON, roughly: the model decomposer's stand-in length
FLOOR_TEXT_TOKENS = 512  # a floor plan's KV beyond its image tokens (text, template), for batching

MMRAG = "mmrag"
MMRAG_PER_SUB_QUESTION = "mmrag_per_sub_question"
MMRAG_PER_IMAGE = "mmrag_per_image"
MMRAG_MODEL_DECOMPOSER = "mmrag_model_decomposer"
MMRAG_EVERY_PAGE = "mmrag_every_page"
FLOOR = "floor"
LLAMAINDEX = "llamaindex"
LLAMAINDEX_SUBQ = "llamaindex_subq"
# The order they run in at each length: the floor right after mmrag (it opens the index mmrag serve held).
SIDES = (MMRAG, FLOOR, MMRAG_EVERY_PAGE, MMRAG_PER_IMAGE, MMRAG_PER_SUB_QUESTION, MMRAG_MODEL_DECOMPOSER,
         LLAMAINDEX, LLAMAINDEX_SUBQ)
REFERENCE_ONLY = (MMRAG_EVERY_PAGE, MMRAG_PER_IMAGE, MMRAG_PER_SUB_QUESTION, MMRAG_MODEL_DECOMPOSER)
# mmrag's own one-prompt page budget (MMRAG_ONE_PROMPT_PAGES), pinned for its default side whatever is set here;
# mmrag_every_page, the other candidate, shows every retrieved page (0).
ONE_PROMPT_PAGES = Settings.model_fields["one_prompt_pages"].default

# Wanted questions/s of mmrag over the llama-index one-shot, by answer length; 1.0 at any other length.
QPS_OVER_LLAMAINDEX = {4: 2.0, 128: 1.5, 512: 1.2}

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

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1 or len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"lengths must be distinct answer lengths of at least 1 token, got {self.lengths}")

    @property
    def reference_length(self) -> int:
        """Where the mmrag variants run and single-length targets are checked (module docstring)."""
        return REFERENCE_LENGTH if REFERENCE_LENGTH in self.lengths else self.lengths[0]

    def sides_at(self, length: int) -> tuple[str, ...]:
        return tuple(s for s in SIDES if s not in REFERENCE_ONLY or length == self.reference_length)


@dataclass(slots=True, frozen=True)
class E2EQuestion:
    text: str
    pages: tuple[int, ...]  # the figures it asks about (page indices), one per designed sub-question


def make_questions(corpus: BenchCorpus, spec: E2ESpec) -> list[E2EQuestion]:
    """Deterministic compound questions: 2 or 3 clauses, each about one figure (Zipf over popularity) by its
    number and its title's subject ("revenue by quarter"), joined so the rule splitter recovers the clauses."""
    rng = np.random.default_rng([spec.seed, zlib.crc32(b"e2e-questions")])
    n = len(corpus.pages)
    probs = zipf_probabilities(n, spec.zipf_s)
    out = []
    for _ in range(spec.questions):
        pages = tuple(int(p) for p in rng.choice(n, size=min(n, int(rng.integers(2, 4))), replace=False, p=probs))
        clauses = [_ASKS[int(rng.integers(len(_ASKS)))].format(what=_subject(corpus.pages[p].title), n=p + 1)
                   for p in pages]
        if len(clauses) == 2:
            text = f"{clauses[0]}, and {clauses[1]}?"
        else:
            text = "; ".join(clauses[:-1]) + f"; and {clauses[-1]}?"
        out.append(E2EQuestion(text[0].upper() + text[1:], pages))
    return out


def _subject(title: str) -> str:
    return title.partition(": ")[2] or title  # "Figure 3: headcount by quarter" -> "headcount by quarter"


def decompose_stand_in(questions: Sequence[E2EQuestion]) -> dict:
    """The tokens a real model's decomposition would decode: its reply is the rules' sub-questions as the JSON
    the model decomposer asks for, at ~4 characters per token, averaged over the questions."""
    rules = RuleDecomposer(max_n=MAX_SUB_QUESTIONS)
    chars = [len(json.dumps({"sub_questions": rules.split(q.text)})) for q in questions]
    mean = sum(chars) / len(chars)
    return {"fixed_tokens": max(1, round(mean / CHARS_PER_TOKEN)), "mean_reply_chars": round(mean, 1),
            "chars_per_token": CHARS_PER_TOKEN,
            "how": 'round(mean over the questions of len(json.dumps({"sub_questions": <the rules\' sub-questions>}))'
                   f" / {CHARS_PER_TOKEN})"}


# --- one side's outcome ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    latency_s: float
    ttft_s: float | None  # first streamed token of the answer as the client sees it; None if none came
    answer: str
    cited: tuple[int, ...]  # page indices cited (mmrag, floor) or given to the model (llama-index)
    asked: tuple[int, ...]
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
    return {"answer": o.answer, "cited_pages": list(o.cited), "asked_pages": list(o.asked)}


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
# serve` would: the composition root (mmrag/bench_cmd.py) passes it, since bench/ does not import the wiring.
FloorPipeline = Callable[[dict[str, str]], tuple[Engine, "Pipeline"]]


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

    def env(self) -> dict[str, str]:
        """mmrag's settings for `mmrag ingest` and `mmrag serve` (the engine flags live on the replica)."""
        return {**os.environ, "MMRAG_DATA_DIR": str(self.root / "mmrag"), "MMRAG_MODEL": str(self.model_path),
                "MMRAG_OCR": "true", "MMRAG_ANSWER_MAX_TOKENS": str(max(self.spec.lengths)),
                "MMRAG_TOP_K": str(self.spec.top_k), "MMRAG_MAX_MODEL_LEN": str(self.engine_config.max_model_len),
                "MMRAG_MAX_IMAGES_PER_PROMPT": str(self.engine_config.max_images_per_prompt),
                "MMRAG_MAX_SUB_QUESTIONS": str(MAX_SUB_QUESTIONS),
                "MMRAG_MAX_QUESTIONS_IN_FLIGHT": str(max(32, self.spec.concurrency)), "MMRAG_API_KEY": "",
                "MMRAG_WARM_TOP": str(WARM_TOP),
                # mmrag's defaults, whatever is set: the variants change them on purpose (MmragVariant)
                "MMRAG_ANSWER_MODE": "auto", "MMRAG_DECOMPOSER": "auto", "MMRAG_DECOMPOSE_FIXED_TOKENS": "0",
                "MMRAG_ONE_PROMPT_PAGES": str(ONE_PROMPT_PAGES),
                # Every side's answers decode exactly the asked length (make_llm does the same for llama-index):
                # a random-weight model stops wherever it draws an end of sequence.
                "MMRAG_ANSWER_FIXED_LENGTH": "true",
                "MMRAG_REDIS_URL": "", "MMRAG_QDRANT_URL": "",  # this run's own local stores, whatever is set
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
    from adapters.qdrant import PageIndex, open_qdrant
    from core.settings import Settings

    settings = Settings(data_dir=inputs.root / "mmrag", qdrant_url="")
    index = PageIndex(open_qdrant("", settings.qdrant_path), settings.qdrant_collection, text_dim=0, image_dim=0)
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


async def ask_streamed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[dict, float | None]:
    """POST /v1/ask with ``"stream": true``: the final answer (the ``done`` event's) and the ``perf_counter`` time
    of the first ``token`` event (None if none came)."""
    first, answer = None, None
    async with client.stream("POST", f"{url}/v1/ask", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise E2EError(f"mmrag serve answered {resp.status_code} to {body['question']!r}: {resp.text[:400]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue  # the event line repeats the data's "event"; blank lines end an event
            event = json.loads(line[len("data: "):])
            if event["event"] == "token" and first is None:
                first = time.perf_counter()
            elif event["event"] == "error":
                raise E2EError(f"mmrag serve's stream ended in an error for {body['question']!r}: {event}")
            elif event["event"] == "done":
                answer = event["answer"]
    if answer is None:
        raise E2EError(f"mmrag serve's stream for {body['question']!r} ended without its `done` event")
    return answer, first


def answer_completions(answer: dict) -> int:
    """Engine requests an answer made (its usage covers them): one prompt's one, or each sub-answer and, when there
    are several, the synthesis; none when no page was found."""
    if not answer["citations"]:
        return 0
    if answer.get("answer_mode") == "one_prompt":
        return 1
    subs = len(answer.get("sub_answers") or [])
    return subs + (subs > 1)


def _check_contract(answer: dict, question: str, length: int, variant: MmragVariant) -> None:
    """The request fields this bench relies on were honoured: a server that ignores them would be measured at
    another length or mode without saying so."""
    mode = answer.get("answer_mode")
    if answer["citations"] and mode not in ("one_prompt", "per_image", "per_sub_question"):
        raise E2EError(f"mmrag serve's answer to {question!r} has no answer_mode: this checkout's server predates "
                       "the one-prompt answer mode (issue 22)")
    wanted = variant.request.get("answer_mode")
    if answer["citations"] and wanted not in (None, "auto") and mode != wanted:
        raise E2EError(f"asked answer_mode={wanted}, mmrag serve answered {question!r} with {mode}")
    if mode == "one_prompt" and answer["usage"]["completion_tokens"] > length:
        raise E2EError(f"asked max_tokens={length}, mmrag serve generated {answer['usage']['completion_tokens']} "
                       f"tokens for {question!r}: it ignores the request's max_tokens")


async def run_mmrag(inputs: E2EInputs, shared: Shared, length: int, variant: MmragVariant) -> dict:
    """A fresh `mmrag serve` on the reset replica (it warms it at start-up), the questions, then it is stopped."""
    await reset_caches(shared.client, shared.replica_url)
    log_path = inputs.root / "logs" / f"mmrag-serve-{variant.side}-{length}.log"
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
                               tuple(shared.page_of_doc[c["doc"]] for c in answer["citations"]), q.pages,
                               {"usage": answer["usage"], "sub_questions": len(answer["sub_questions"]),
                                "source": answer["sub_question_source"], "answer_mode": answer.get("answer_mode"),
                                "completions": answer_completions(answer), "timings": answer.get("timings") or {}})

            before = await scrape(client, shared.replica_url), await scrape(client, server.url)
            outcomes, wall = await closed_loop(shared.questions, inputs.spec.concurrency, ask)
            await asyncio.sleep(DRAIN_WAIT_S)
            after = await scrape(client, shared.replica_url), await scrape(client, server.url)
    finally:
        server.stop()
    return {**summarize(outcomes, wall), **mmrag_breakdown(outcomes, before, after),
            "serve_start_s": round(start_s, 1), "warm_top": WARM_TOP, "settings": variant.env,
            "request": variant.request, "sample_answer": _sample(outcomes[0])}


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
        "answer_completions_per_question": round(answered / n, 3),  # one prompt's, or sub-answers + synthesis
        **_percentiles("engine_ttft", ttft),  # per engine request of an answer, from its dispatch
        "answer_modes": _counts(o.extra["answer_mode"] or "none" for o in outcomes),
        "sub_question_sources": _counts(o.extra["source"] for o in outcomes),
        "decomposed_as_designed": round(sum(o.extra["sub_questions"] == len(o.asked) for o in outcomes) / n, 3),
        # The answers' own wall time per stage (rag/pipeline.py), mean per question; a stage that did not run
        # for a question counts 0 there.
        "stage_s": {stage: round(sum(o.extra["timings"].get(stage) or 0.0 for o in outcomes) / n, 4)
                    for stage in STAGES},
    }


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


# --- the floor: mmrag's one-prompt plans with every image already in KV --------------------------------------


async def record_plans(pipe: Pipeline, questions: Sequence[E2EQuestion], length: int,
                       page_of_doc: dict[str, int]) -> list[tuple[PromptPlan, tuple[int, ...]]]:
    """Each question's one-prompt plan as mmrag's pipeline makes it (its ``submit`` records and answers nothing),
    with the pages it cites."""
    plans: list[PromptPlan] = []

    async def record(plan: PromptPlan, *, on_text=None) -> Completion:
        plans.append(plan)
        return Completion(text="", token_ids=[], usage=Usage(), model="")

    pipe.submit = record
    out = []
    for q in questions:  # in order, as the closed loop starts them: the popularity order learns the same way
        answer = await pipe.ask(q.text, max_tokens=length, answer_mode="one_prompt")
        if len(plans) != len(out) + 1:
            raise E2EError(f"mmrag's one-prompt answer to {q.text!r} sent {len(plans) - len(out)} plans, not 1")
        out.append((plans[-1], tuple(page_of_doc[c.doc] for c in answer.citations)))
    return out


def floor_batches(costs: Sequence[tuple[PromptPlan, int]], budget: int) -> list[list[int]]:
    """Consecutive questions, grouped so each group's distinct plans (a plan asked twice is cached once) cost at
    most ``budget`` KV tokens together; a plan over the budget alone is a group of its own."""
    batches: list[list[int]] = []
    seen: set[PromptPlan] = set()
    used = 0
    for i, (plan, cost) in enumerate(costs):
        extra = 0 if plan in seen else cost
        if not batches or used + extra > budget:
            batches.append([])
            seen, used, extra = set(), 0, cost
        batches[-1].append(i)
        seen.add(plan)
        used += extra
    return batches


def _prefill_only(plan: PromptPlan) -> PromptPlan:
    """The plan generating one token: its prompt's KV stays in the cache for the timed run of the same plan."""
    return replace(plan, sampling=replace(plan.sampling, max_tokens=1, min_tokens=0))


async def run_floor(inputs: E2EInputs, shared: Shared, length: int) -> dict:
    """The floor at ``length``: after mmrag's run (its server stopped, so its Qdrant folder is free)."""
    env = {**inputs.env(), "MMRAG_ENGINE_URLS": shared.replica_url}
    engine, pipe = inputs.floor_pipeline(env)
    try:
        recorded = await record_plans(pipe, shared.questions, length, shared.page_of_doc)
        costs = [(plan, pipe.token_counts.of_plan(plan) + FLOOR_TEXT_TOKENS) for plan, _ in recorded]
        capacity = await engine.kv_capacity()
        batches = floor_batches(costs, capacity.tokens // 2)
        await reset_caches(shared.client, shared.replica_url)
        outcomes: list[Outcome] = []
        engine_delta: dict[str, float] = {}
        wall = fill_s = 0.0

        async def ask(i: int) -> Outcome:
            plan, cited = recorded[i]
            t0 = time.perf_counter()
            first: list[float] = []
            completion = await engine.generate(plan, on_first_token=lambda: first.append(time.perf_counter()))
            return Outcome(time.perf_counter() - t0, first[0] - t0 if first else None, completion.text, cited,
                           shared.questions[i].pages)

        for batch in batches:
            t = time.perf_counter()
            distinct = list(dict.fromkeys(recorded[i][0] for i in batch))
            await asyncio.gather(*(engine.generate(_prefill_only(p)) for p in distinct))
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
    return {**summarize(outcomes, wall), **engine_breakdown(engine_delta, len(outcomes)),
            "batches": len(batches), "kv_budget_tokens": capacity.tokens // 2, "prefill_untimed_s": round(fill_s, 1),
            "images_per_plan_mean": round(sum(len(p.images) for p, _ in recorded) / len(recorded), 2),
            "sample_answer": _sample(outcomes[0])}


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


def make_llm(url: str, model_path: Path, max_tokens: int, context_window: int) -> OpenAILike:
    """The replica's OpenAI-compatible API; greedy, no retries (a failure must show, not be retried away). Every
    completion decodes exactly ``max_tokens`` (vLLM's ``min_tokens``, as mmrag's MMRAG_ANSWER_FIXED_LENGTH): a
    random-weight model's answers would otherwise stop at random lengths, and no side would answer at the length
    asked."""
    return OpenAILike(model=str(model_path), api_base=f"{url}/v1", api_key="unused", is_chat_model=True,
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
                         ) -> dict:
    llm = make_llm(shared.replica_url, inputs.model_path, length,
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
                       q.pages, extra)

    before = await scrape(shared.client, shared.replica_url)
    outcomes, wall = await closed_loop(shared.questions, inputs.spec.concurrency, ask)
    after = await scrape(shared.client, shared.replica_url)
    out = {**summarize(outcomes, wall), **engine_breakdown(delta(before, after, _VLLM + _VLLM_COUNTERS), len(outcomes)),
           "context_window_told": llm.context_window, "sample_answer": _sample(outcomes[0])}
    if subq:
        out["sub_questions_per_question"] = round(sum(o.extra["sub_questions"] for o in outcomes) / len(outcomes), 3)
    return out


# --- targets -----------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _target(name: str, measured: float | None, wanted: str, met: bool) -> dict:
    return {"name": name, "measured": measured, "wanted": wanted, "met": bool(met)}


def targets(by_length: dict[str, dict[str, dict]], reference: int) -> list[dict]:
    """Issue 22's targets, each from this one run: questions/s over the llama-index one-shot at every length;
    the rest at the reference length."""
    out = []
    for key, sides in by_length.items():
        wanted = QPS_OVER_LLAMAINDEX.get(int(key), 1.0)
        r = _ratio(sides[MMRAG]["questions_per_s"], sides[LLAMAINDEX]["questions_per_s"])
        out.append(_target(f"questions/s mmrag / llamaindex at {key} tokens", r, f">= {wanted}",
                           r is not None and r >= wanted))
    ref = by_length[str(reference)]
    m, li = ref[MMRAG], ref[LLAMAINDEX]
    at = f"at {reference} tokens"
    for other, wanted in ((FLOOR, 0.9), (LLAMAINDEX_SUBQ, 3.0)):
        r = _ratio(m["questions_per_s"], ref[other]["questions_per_s"])
        out.append(_target(f"questions/s mmrag / {other} {at}", r, f">= {wanted}", r is not None and r >= wanted))
    r = _ratio(m["ttft_p50_s"], li["ttft_p50_s"])
    out.append(_target(f"TTFT p50 mmrag / llamaindex {at}", r, "<= 0.5", r is not None and r <= 0.5))
    r = _ratio(m["generation_tokens_per_question"], li["generation_tokens_per_question"])
    out.append(_target(f"generated tokens per question mmrag / llamaindex {at}", r, "<= 1.1",
                       r is not None and r <= 1.1))
    d = round(m["asked_pages_cited"] - li["asked_pages_cited"], 3)
    out.append(_target(f"asked pages cited, mmrag minus llamaindex {at}", d, ">= 0", d >= 0))
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


def estimate_runs(spec: E2ESpec, step_s: float, request_s: float, stand_in_tokens: int) -> dict[tuple[str, int],
                                                                                                  float]:
    """Seconds per (side, length), before anything ran: see :class:`Progress`."""
    rounds = -(-spec.questions // spec.concurrency)  # closed loop: questions / concurrency at a time
    subs = 3  # the questions' 2-3 clauses, each a sub-question
    out = {}
    for length in spec.lengths:
        sub = min(64, length)  # mmrag's sub-answers (MMRAG_SUB_ANSWER_MAX_TOKENS)
        chains = {MMRAG: (length, 1), MMRAG_EVERY_PAGE: (length, 1), MMRAG_PER_IMAGE: (-(-length // subs), 1),
                  MMRAG_PER_SUB_QUESTION: (sub + length, 2),
                  MMRAG_MODEL_DECOMPOSER: (stand_in_tokens + length, 2), FLOOR: (length, 1),
                  LLAMAINDEX: (length, 1), LLAMAINDEX_SUBQ: (2 * length, subs + 1)}
        for side in spec.sides_at(length):
            tokens, requests = chains[side]
            start = SERVE_START_S if side.startswith(MMRAG) else 0.0
            out[(side, length)] = start + rounds * (tokens * step_s + requests * request_s)
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
    """Ingest, one replica, then every length's sides one after the other; the JSON section ``e2e``."""
    from qdrant_client import AsyncQdrantClient

    from adapters.embed import TextEmbedder

    spec = inputs.spec
    logs = inputs.root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    questions = make_questions(inputs.corpus, spec)
    stand_in = decompose_stand_in(questions)
    t = time.perf_counter()
    pages = ingest(inputs)
    ingest_s = time.perf_counter() - t
    qdrant_path = inputs.root / "llamaindex-qdrant"
    embed = LlamaIndexEmbedding(TextEmbedder())
    build_index(pages, qdrant_path, LLAMAINDEX_COLLECTION, embed)
    inputs.log(f"e2e: {len(pages)} pages ingested ({ingest_s:.0f} s); {len(questions)} questions, concurrency "
               f"{spec.concurrency}, answer lengths {', '.join(map(str, spec.lengths))} (variants at "
               f"{spec.reference_length}); model decomposer stand-in {stand_in['fixed_tokens']} tokens")
    t = time.perf_counter()
    replica = start_replica(inputs.model_path, inputs.engine_config, logs / "vllm.log", port=free_port())
    replica_start_s = time.perf_counter() - t
    aclient = AsyncQdrantClient(path=str(qdrant_path))
    by_length: dict[str, dict[str, dict]] = {}
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            shared = Shared(questions, replica.url, client, {p.file: p.index for p in inputs.corpus.pages})
            step_s, request_s = await measure_step(client, replica.url, str(inputs.model_path), spec.concurrency)
            progress = Progress(inputs.log, estimate_runs(spec, step_s, request_s, stand_in["fixed_tokens"]))
            estimated_s = progress.total_estimate_s()
            inputs.log(f"e2e: replica {replica.url} ready in {replica_start_s:.0f} s (decode step {step_s * 1e3:.0f} "
                       f"ms); the runs should take about {progress.total_estimate_s() / 60:.0f} min")
            retriever = make_retriever(aclient, LLAMAINDEX_COLLECTION, embed, spec.top_k)
            variants = {MMRAG: MmragVariant(MMRAG),
                        MMRAG_EVERY_PAGE: MmragVariant(MMRAG_EVERY_PAGE, env={"MMRAG_ONE_PROMPT_PAGES": "0"}),
                        MMRAG_PER_IMAGE: MmragVariant(MMRAG_PER_IMAGE, request={"answer_mode": "per_image"}),
                        MMRAG_PER_SUB_QUESTION: MmragVariant(MMRAG_PER_SUB_QUESTION,
                                                             request={"answer_mode": "per_sub_question"}),
                        MMRAG_MODEL_DECOMPOSER: MmragVariant(MMRAG_MODEL_DECOMPOSER, env={
                            "MMRAG_DECOMPOSER": "model",
                            "MMRAG_DECOMPOSE_FIXED_TOKENS": str(stand_in["fixed_tokens"])})}
            for length in spec.lengths:
                results: dict[str, dict] = {}
                for side in spec.sides_at(length):
                    progress.start(side, length)
                    if side in variants:
                        results[side] = await run_mmrag(inputs, shared, length, variants[side])
                    elif side == FLOOR:
                        results[side] = await run_floor(inputs, shared, length)
                    else:
                        results[side] = await run_llamaindex(inputs, shared, length, side, retriever)
                    progress.end(side, length, results[side])
                by_length[str(length)] = results
    finally:
        await aclient.close()
        replica.stop()
    return {
        "spec": asdict(spec) | {"reference_length": spec.reference_length}, "engine": asdict(inputs.engine_config),
        "ingest_s": round(ingest_s, 1), "replica": {"shared_by_every_side": True, "start_s": round(replica_start_s, 1),
                                                    "decode_step_s": round(step_s, 4), "resets": list(RESETS)},
        "question_set": {"designed_sub_questions": [len(q.pages) for q in questions],
                         "texts": [q.text for q in questions]},
        "runs_s": {"estimated": round(estimated_s), "took": round(progress.elapsed())},
        "by_length": by_length,
        "decomposition": decomposition(by_length, spec.reference_length, stand_in),
        "targets": targets(by_length, spec.reference_length),
    }
