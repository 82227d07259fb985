"""`mmrag bench --e2e`: the same questions through `mmrag serve` and through a llama-index pipeline (issue 12).

Both sides run one after the other on the same model, pages, questions, answer length (greedy) and
concurrency, each on its own fresh `vllm serve` replica started with the same engine flags (mmrag's:
32-token blocks, 1 GiB of KV, eager, prefix caching, vLLM's processor and encoder caches at their defaults):

- **mmrag**: `mmrag serve` as a child process, MMRAG_ENGINE_URLS at its replica, asked over HTTP
  (POST /v1/ask: decomposition, retrieval, plans, scheduler, synthesis). It warms its replica at start-up as
  it does by default (MMRAG_WARM_TOP=-1), before the clock starts.
- **llamaindex**: what its documentation shows for RAG with a multimodal model: a ``VectorStoreIndex`` over
  a ``QdrantVectorStore`` (local mode) holding the same page texts, its retriever (top-k as mmrag's), and
  ``OpenAILike`` streaming a chat (``astream_chat``) whose one user message is the retrieved pages as
  ``ImageBlock``s (pixels, retrieval-score order) then a ``TextBlock`` with llama-index's default text-QA
  prompt over the retrieved texts. The first streamed delta is its TTFT. One warm-up chat on a probe page
  (never asked about) first, so neither side pays the engine's first-request cost inside the clock.

The questions (:func:`make_questions`) are compound natural-language questions over the pages' titles:
each asks about 2-3 figures drawn from a Zipf law over page popularity, so decomposition and retrieval
have real work. The page texts are what `mmrag ingest` OCRs from the pages, read back from mmrag's index.

Where mmrag's time goes comes from Prometheus counters scraped before and after its run: the replica's own
``vllm:request_{queue,prefill,decode}_time_seconds`` and mmrag's scheduler queue wait. /v1/ask reports
usage per answer (sub-questions and synthesis, not decomposition), so decomposition's engine share is the
counters' total minus the answers' sum. Retrieval and synthesis wall times are not exported anywhere.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.llms import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode
from llama_index.llms.openai_like import OpenAILike
from llama_index.vector_stores.qdrant import QdrantVectorStore
from pydantic import PrivateAttr

from bench.corpus import BenchCorpus
from bench.workload import zipf_probabilities
from serving.engine.config import EngineConfig
from serving.vllm_launch import ServerHandle, start_server

if TYPE_CHECKING:
    from adapters.embed import TextEmbedder
    from core.payload import PagePayload

_ASKS = (
    "what is the trend of {what} in Figure {n}",
    "which quarter peaks for {what} in Figure {n}",
    "how large is the change in {what} in Figure {n}",
    "what does Figure {n} show about {what}",
)
LLAMAINDEX_COLLECTION = "bench_pages"
WARM_TOP = -1  # `mmrag serve`'s default: warm every page that fits before the first question


class E2EError(RuntimeError):
    """A side failed: a server did not start or answered an error; the message says which and where the log is."""


@dataclass(slots=True, frozen=True)
class E2ESpec:
    questions: int
    concurrency: int = 4
    max_tokens: int = 4  # per completion on both sides: sub-answers, synthesis, the llama-index answer
    top_k: int = 3  # pages per retrieval on both sides (mmrag: per sub-question)
    zipf_s: float = 1.0
    seed: int = 0


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


# --- one side's outcome ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    latency_s: float
    ttft_s: float | None  # first streamed token as the client sees it; None where the API does not stream
    answer: str
    cited: tuple[int, ...]  # page indices cited (mmrag) or retrieved into the prompt (llama-index)
    asked: tuple[int, ...]
    extra: dict = field(default_factory=dict)


async def closed_loop(questions: Sequence[E2EQuestion], concurrency: int,
                      ask: Callable[[E2EQuestion], Awaitable[Outcome]]) -> tuple[list[Outcome], float]:
    """``concurrency`` questions in flight, in order; the outcomes in question order and the wall time."""
    results: list[Outcome | None] = [None] * len(questions)
    queue = list(enumerate(questions))[::-1]

    async def worker() -> None:
        while queue:
            i, q = queue.pop()
            results[i] = await ask(q)

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
        "answers_with_citations": sum(1 for o in outcomes if o.cited and o.answer),
        "asked_pages_cited": round(found / asked, 3) if asked else 0.0,  # retrieval recall of the asked figures
    }


def _percentiles(name: str, values: Sequence[float]) -> dict:
    if not values:
        return {f"{name}_mean_s": None, f"{name}_p50_s": None, f"{name}_p99_s": None}
    a = np.asarray(values)
    return {f"{name}_mean_s": round(float(a.mean()), 4), f"{name}_p50_s": round(float(np.percentile(a, 50)), 4),
            f"{name}_p99_s": round(float(np.percentile(a, 99)), 4)}


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
    from prometheus_client.parser import text_string_to_metric_families

    resp = await client.get(f"{url}/metrics")
    resp.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def delta(before: dict[str, float], after: dict[str, float], names: Sequence[str]) -> dict[str, float]:
    keys = [k for n in names for k in ((f"{n}_sum", f"{n}_count") if not n.endswith("_total") else (n,))]
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}


def engine_breakdown(d: dict[str, float], questions: int) -> dict:
    """Engine seconds per question by phase, over every request the replica served in the run."""
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


# --- the llama-index pipeline, as its documentation builds one -----------------------------------------------


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
    """A fresh Qdrant collection (local mode at ``path``) with one node per page: its text, and the
    file metadata llama-index's readers set (``file_path``, ``file_name``, ``page_label``)."""
    from qdrant_client import QdrantClient

    shutil.rmtree(path, ignore_errors=True)
    client = QdrantClient(path=str(path))
    try:
        store = QdrantVectorStore(collection_name=collection, client=client)
        nodes = [TextNode(id_=p.page_id, text=p.text,
                          metadata={"file_path": p.path, "file_name": p.doc, "page_label": str(p.page)})
                 for p in pages]
        VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store),
                         embed_model=embed_model)
    finally:
        client.close()


def make_retriever(aclient: Any, collection: str, embed_model: BaseEmbedding, top_k: int) -> BaseRetriever:
    store = QdrantVectorStore(collection_name=collection, aclient=aclient)
    return VectorStoreIndex.from_vector_store(store, embed_model=embed_model).as_retriever(similarity_top_k=top_k)


def make_llm(url: str, model_path: Path, max_tokens: int, context_window: int) -> OpenAILike:
    """The replica's OpenAI-compatible API; greedy, no retries (a failure must show, not be retried away)."""
    return OpenAILike(model=str(model_path), api_base=f"{url}/v1", api_key="unused", is_chat_model=True,
                      context_window=context_window, max_tokens=max_tokens, temperature=0.0, timeout=900.0,
                      max_retries=0)


async def stream_answer(llm: OpenAILike, nodes: Sequence[NodeWithScore], question: str, *,
                        images: Sequence[Path]) -> tuple[str, float | None]:
    """One chat: the page images, then llama-index's default text-QA prompt over the retrieved texts.
    The answer and the ``perf_counter`` time of its first streamed delta (None if nothing came back)."""
    context = "\n\n".join(n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes)
    blocks: list = [ImageBlock(path=p, image_mimetype="image/png") for p in images]
    blocks.append(TextBlock(text=DEFAULT_TEXT_QA_PROMPT.format(context_str=context, query_str=question)))
    stream = await llm.astream_chat([ChatMessage(role=MessageRole.USER, blocks=blocks)])
    first, text = None, ""
    async for chunk in stream:
        if first is None and chunk.delta:
            first = time.perf_counter()
        text = chunk.message.content or ""
    return text, first


# --- processes ---------------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(model_path: Path, config: EngineConfig, log_path: Path) -> ServerHandle:
    handle = start_server(model_path, config, port=free_port(), log_path=log_path)
    try:
        handle.wait_ready(timeout=600)
    except BaseException:
        handle.stop()
        raise
    return handle


def start_mmrag_serve(env: dict[str, str], log_path: Path, timeout_s: float = 600) -> ServerHandle:
    """`mmrag serve` as a child process in its own session, stopped like a replica (SIGINT, then SIGKILL)."""
    port = free_port()
    env = {**env, "MMRAG_HOST": "127.0.0.1", "MMRAG_PORT": str(port)}
    with log_path.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mmrag", "serve"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:  # uvicorn binds after the lifespan (services + warm-up) has finished
            if proc.poll() is not None or time.monotonic() > deadline:
                handle.stop()
                raise E2EError(f"mmrag serve did not become ready (exit code {proc.returncode}); log {log_path}:\n"
                               f"{handle.log_tail(30)}")
            try:
                if client.get(f"{handle.url}/readyz").status_code == 200:
                    return handle
            except httpx.TransportError:
                pass
            time.sleep(0.5)


# --- the run -----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class E2EInputs:
    model_path: Path
    corpus: BenchCorpus
    spec: E2ESpec
    engine_config: EngineConfig
    root: Path  # this corpus' e2e folder: pages/, mmrag/ (MMRAG_DATA_DIR), llamaindex-qdrant/, logs/
    log: Callable[[str], None]

    @property
    def pages_dir(self) -> Path:
        return self.root / "pages"

    def env(self) -> dict[str, str]:
        """mmrag's settings for `mmrag ingest` and `mmrag serve` (the engine flags live on the replica)."""
        return {**os.environ, "MMRAG_DATA_DIR": str(self.root / "mmrag"), "MMRAG_MODEL": str(self.model_path),
                "MMRAG_OCR": "true", "MMRAG_ANSWER_MAX_TOKENS": str(self.spec.max_tokens),
                "MMRAG_TOP_K": str(self.spec.top_k), "MMRAG_MAX_MODEL_LEN": str(self.engine_config.max_model_len),
                "MMRAG_MAX_IMAGES_PER_PROMPT": str(self.engine_config.max_images_per_prompt),
                "MMRAG_MAX_QUESTIONS_IN_FLIGHT": str(max(32, self.spec.concurrency)), "MMRAG_API_KEY": "",
                "MMRAG_WARM_TOP": str(WARM_TOP),
                "MMRAG_REDIS_URL": "", "MMRAG_QDRANT_URL": "",  # this run's own local stores, whatever is set
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


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


async def run_mmrag(inputs: E2EInputs, questions: Sequence[E2EQuestion], page_of_doc: dict[str, int]) -> dict:
    logs = inputs.root / "logs"
    replica = start_replica(inputs.model_path, inputs.engine_config, logs / "vllm-mmrag.log")
    server = None
    try:
        server = start_mmrag_serve({**inputs.env(), "MMRAG_ENGINE_URLS": replica.url}, logs / "mmrag-serve.log")
        inputs.log(f"e2e mmrag: serving at {server.url} on replica {replica.url}")
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:

            async def ask(q: E2EQuestion) -> Outcome:
                t0 = time.perf_counter()
                resp = await client.post(f"{server.url}/v1/ask", json={"question": q.text})
                latency = time.perf_counter() - t0
                if resp.status_code != 200:
                    raise E2EError(f"mmrag serve answered {resp.status_code} to {q.text!r}: {resp.text[:400]}")
                body = resp.json()
                subs = len(body.get("sub_answers") or [])
                return Outcome(latency, None, body["answer"], tuple(page_of_doc[c["doc"]] for c in body["citations"]),
                               q.pages, {"usage": body["usage"], "sub_questions": len(body["sub_questions"]),
                                         "source": body["sub_question_source"],
                                         "completions": subs + (subs > 1), "timings": body.get("timings") or {}})

            before = await scrape(client, replica.url), await scrape(client, server.url)
            outcomes, wall = await closed_loop(questions, inputs.spec.concurrency, ask)
            await asyncio.sleep(DRAIN_WAIT_S)
            after = await scrape(client, replica.url), await scrape(client, server.url)
    finally:
        if server is not None:
            server.stop()
        replica.stop()
    return {**summarize(outcomes, wall), **mmrag_breakdown(outcomes, before, after),
            "warm_top": WARM_TOP, "answer_api_streams": False, "sample_answer": _sample(outcomes[0])}


def mmrag_breakdown(outcomes: Sequence[Outcome], before: tuple[dict, dict], after: tuple[dict, dict]) -> dict:
    """Where mmrag's time goes, per question: engine seconds by phase (the replica's histograms, every
    request), the scheduler's queue wait, and decomposition's share. MeteredEngine counts every completion
    and the answers' usage covers sub-questions and synthesis only, so decomposition is the difference; its
    decode seconds are estimated from its share of the generated tokens (vLLM does not label requests)."""
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
        **{f"decompose_{k}_per_question": round(v / n, 4) for k, v in decompose.items()},
        "decompose_decode_s_estimated": round(decode_share * engine["vllm:request_decode_time_seconds_sum"] / n, 4),
        "answer_completions_per_question": round(answered / n, 3),  # sub-answers + synthesis
        **_percentiles("engine_ttft", ttft),  # per engine request of an answer, from its dispatch
        "sub_question_sources": {s: sum(1 for o in outcomes if o.extra["source"] == s)
                                 for s in sorted({o.extra["source"] for o in outcomes})},
        "decomposed_as_designed": round(sum(o.extra["sub_questions"] == len(o.asked) for o in outcomes) / n, 3),
        # The answers' own wall time per stage (rag/pipeline.py), mean per question; a stage that did not run
        # for a question counts 0 there.
        "stage_s": {stage: round(sum(o.extra["timings"].get(stage, 0.0) for o in outcomes) / n, 4)
                    for stage in ("decompose_s", "retrieve_s", "sub_answers_s", "synthesis_s")},
    }


async def run_llamaindex(inputs: E2EInputs, questions: Sequence[E2EQuestion], pages: list[PagePayload],
                         page_of_doc: dict[str, int]) -> dict:
    from qdrant_client import AsyncQdrantClient

    from adapters.embed import TextEmbedder

    qdrant_path = inputs.root / "llamaindex-qdrant"
    embed = LlamaIndexEmbedding(TextEmbedder())
    build_index(pages, qdrant_path, LLAMAINDEX_COLLECTION, embed)
    logs = inputs.root / "logs"
    replica = start_replica(inputs.model_path, inputs.engine_config, logs / "vllm-llamaindex.log")
    aclient = AsyncQdrantClient(path=str(qdrant_path))
    try:
        retriever = make_retriever(aclient, LLAMAINDEX_COLLECTION, embed, inputs.spec.top_k)
        llm = make_llm(replica.url, inputs.model_path, inputs.spec.max_tokens, inputs.engine_config.max_model_len)
        probe = inputs.corpus.root / inputs.corpus.probes[0].file
        await stream_answer(llm, [], "What does this figure show?", images=[probe])  # the replica's first request
        inputs.log(f"e2e llamaindex: replica {replica.url}")

        async def ask(q: E2EQuestion) -> Outcome:
            t0 = time.perf_counter()
            nodes = await retriever.aretrieve(q.text)
            retrieved = time.perf_counter()
            images = [Path(n.node.metadata["file_path"]) for n in nodes]
            text, first = await stream_answer(llm, nodes, q.text, images=images)
            done = time.perf_counter()
            return Outcome(done - t0, first - t0 if first else None, text,
                           tuple(page_of_doc[n.node.metadata["file_name"]] for n in nodes), q.pages,
                           {"retrieve_s": retrieved - t0})

        async with httpx.AsyncClient(timeout=30.0) as client:
            before = await scrape(client, replica.url)
            outcomes, wall = await closed_loop(questions, inputs.spec.concurrency, ask)
            after = await scrape(client, replica.url)
    finally:
        await aclient.close()
        replica.stop()
    engine = delta(before, after, _VLLM + _VLLM_COUNTERS)
    n = len(outcomes)
    return {**summarize(outcomes, wall), **engine_breakdown(engine, n),
            "retrieve_s": round(sum(o.extra["retrieve_s"] for o in outcomes) / n, 4),
            "answer_api_streams": True, "sample_answer": _sample(outcomes[0])}


def _sample(o: Outcome) -> dict:
    return {"answer": o.answer, "cited_pages": list(o.cited), "asked_pages": list(o.asked)}


async def run_e2e(inputs: E2EInputs) -> dict:
    """Ingest, then mmrag's side, then llama-index's, one after the other; the JSON section ``e2e``."""
    (inputs.root / "logs").mkdir(parents=True, exist_ok=True)
    questions = make_questions(inputs.corpus, inputs.spec)
    t = time.perf_counter()
    pages = ingest(inputs)
    ingest_s = time.perf_counter() - t
    page_of_doc = {p.file: p.index for p in inputs.corpus.pages}
    inputs.log(f"e2e: {len(pages)} pages ingested ({ingest_s:.0f} s); {len(questions)} questions, "
               f"concurrency {inputs.spec.concurrency}")
    mmrag = await run_mmrag(inputs, questions, page_of_doc)
    inputs.log(f"e2e mmrag: {mmrag['questions_per_s']:.3f} questions/s")
    llamaindex = await run_llamaindex(inputs, questions, pages, page_of_doc)
    inputs.log(f"e2e llamaindex: {llamaindex['questions_per_s']:.3f} questions/s")
    ratio = mmrag["questions_per_s"] / llamaindex["questions_per_s"] if llamaindex["questions_per_s"] else 0.0
    return {
        "spec": asdict(inputs.spec), "engine": asdict(inputs.engine_config),
        "ingest_s": round(ingest_s, 1),
        "question_set": {"designed_sub_questions": [len(q.pages) for q in questions],
                         "examples": [q.text for q in questions[:3]]},
        "mmrag": mmrag, "llamaindex": llamaindex,
        "target": {"name": "questions/s mmrag / llamaindex", "measured": round(ratio, 3), "wanted": ">= 2.0",
                   "met": ratio >= 2.0},
    }
