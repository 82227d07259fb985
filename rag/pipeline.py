"""The RAG pipeline: question → sub-questions → pages per sub-question → prompt plans → cited answer.

One prompt plan per sub-question (its pages + the sub-question). Pages within every plan follow the
canonical order of the batch, so sub-questions that retrieve the same figure share its KV prefix; a final
text-only prompt synthesises the sub-answers. Every step is async; nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from core.keys import ImageKey
from core.settings import Settings
from ingestion.embed import ImageEmbedder, TextEmbedder
from rag.answer import Answer, Citation
from rag.decompose import Decomposer
from rag.order import canonical_order
from retrieval.search import Hit, PageSearcher, open_async_qdrant
from serving.engine.base import Completion, Engine, Layout, PromptPlan, SamplingSpec, Usage
from serving.scheduler import Policy, Scheduler, SchedulerConfig

NO_PAGES_ANSWER = "No relevant pages were found in the ingested documents for this question."

# Where plans go: straight to the engine, or through the prefix-aware scheduler (serving/scheduler).
Submit = Callable[[PromptPlan], Awaitable[Completion]]


@dataclass(slots=True, frozen=True)
class PipelineConfig:
    top_k: int = 3  # pages per sub-question
    max_tokens: int = 128
    layout: Layout = Layout.CANONICAL


def build_plans(sub_questions: Sequence[str], hits: Sequence[Sequence[Hit]], *, max_tokens: int,
                layout: Layout = Layout.CANONICAL) -> list[PromptPlan]:
    """One plan per sub-question that found pages. Canonical layout: images in the batch's canonical order;
    naive layout (the baseline): images in retrieval-score order, question first."""
    keyed = [[h.image_key for h in hs] for hs in hits]
    orders = canonical_order(keyed) if layout is Layout.CANONICAL else [list(dict.fromkeys(k)) for k in keyed]
    sampling = SamplingSpec(max_tokens=max_tokens)
    return [
        PromptPlan(images=tuple(order), text=q, sampling=sampling, layout=layout)
        for q, order in zip(sub_questions, orders)
        if order
    ]


def cite(hits: Sequence[Sequence[Hit]]) -> list[Citation]:
    """Every retrieved page once, with its best score, best first."""
    best: dict[tuple[str, int], Hit] = {}
    for hit in (h for hs in hits for h in hs):
        k = (hit.doc, hit.page)
        if k not in best or hit.score > best[k].score:
            best[k] = hit
    ranked = sorted(best.values(), key=lambda h: (-h.score, h.doc, h.page))
    return [Citation(h.doc, h.page, h.score, str(h.image_key)) for h in ranked]


def synthesis_plan(question: str, sub_questions: Sequence[str], answers: Sequence[str], max_tokens: int
                   ) -> PromptPlan:
    lines = [f"Question: {question}"]
    lines += [f"Sub-question {i}: {q}\nAnswer {i}: {a.strip()}" for i, (q, a) in enumerate(zip(sub_questions, answers), 1)]
    return PromptPlan(images=(), text="\n".join(lines), system_prompt_id="synthesize",
                      sampling=SamplingSpec(max_tokens=max_tokens))


class Pipeline:
    def __init__(self, decomposer: Decomposer, searcher: PageSearcher, engine: Engine, *,
                 config: PipelineConfig = PipelineConfig(), submit: Submit | None = None) -> None:
        self.decomposer = decomposer
        self.searcher = searcher
        self.engine = engine
        self.config = config
        self.submit = submit or engine.generate
        self.scheduler: Scheduler | None = None
        self.token_counts: dict[ImageKey, int] = {}  # from retrieval payloads; the scheduler's admission reads it

    def plan_image_tokens(self, plan: PromptPlan) -> int:
        return sum(self.token_counts.get(k, 0) for k in plan.images)

    async def ask(self, question: str, *, docs: list[str] | None = None) -> Answer:
        decomposition = await self.decomposer.decompose(question)
        subs = decomposition.sub_questions
        hits = await self.searcher.search_many(subs, doc_filter=docs, top_k=self.config.top_k)
        usage = Usage()
        if not any(hits):
            return self._answer(NO_PAGES_ANSWER, decomposition, [], usage)
        self.token_counts.update((h.image_key, h.image_tokens) for hs in hits for h in hs)
        plans = build_plans(subs, hits, max_tokens=self.config.max_tokens, layout=self.config.layout)
        completions = await asyncio.gather(*(self.submit(p) for p in plans))
        for c in completions:
            usage.add(c.usage)
        answered = [p.text for p in plans]
        if len(completions) == 1:
            text = completions[0].text
        else:
            final = await self.submit(synthesis_plan(question, answered, [c.text for c in completions],
                                                     self.config.max_tokens))
            usage.add(final.usage)
            text = final.text
        answer = self._answer(text, decomposition, cite(hits), usage)
        answer.extra["sub_answers"] = [{"sub_question": q, "answer": c.text} for q, c in zip(answered, completions)]
        return answer

    def _answer(self, text: str, decomposition, citations: list[Citation], usage: Usage) -> Answer:
        return Answer(
            answer=text,
            sub_questions=decomposition.sub_questions,
            citations=citations,
            usage=usage,
            model=self.engine.model_name,
            random_weights=self.engine.random_weights,
            sub_question_source=decomposition.source,
        )



def scheduler_config(settings: Settings) -> SchedulerConfig:
    return SchedulerConfig(
        policy=Policy(settings.scheduler_policy),
        max_concurrency=settings.max_concurrency,
        max_image_tokens_in_flight=settings.max_image_tokens_in_flight,
        max_wait_ms=settings.max_wait_ms,
        queue_cap=settings.queue_cap,
    )


def open_pipeline(settings: Settings, engine: Engine) -> Pipeline:
    """The pipeline over the configured index, its plans going through one prefix-aware scheduler.

    The caller owns the engine (and closes ``pipeline.searcher.client``).
    """
    text = TextEmbedder(settings.text_embedder, batch_size=settings.embed_batch_size)
    image = ImageEmbedder(settings.clip_model, settings.clip_weights) if settings.image_channel else None
    searcher = PageSearcher(open_async_qdrant(settings.qdrant_url, settings.qdrant_path), settings.qdrant_collection,
                            text, image, top_k=settings.top_k)
    decomposer = Decomposer(engine, max_n=settings.max_sub_questions, max_question_chars=settings.max_question_chars)
    config = PipelineConfig(top_k=settings.top_k, max_tokens=settings.answer_max_tokens)
    pipeline = Pipeline(decomposer, searcher, engine, config=config)
    pipeline.scheduler = Scheduler(engine, scheduler_config(settings), image_tokens=pipeline.plan_image_tokens)
    pipeline.submit = pipeline.scheduler.submit
    return pipeline
