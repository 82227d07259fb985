"""The RAG pipeline: question → sub-questions → pages per sub-question → prompt plans → cited answer.

One prompt plan per sub-question (its pages + the sub-question). Pages within every plan follow the
canonical order of the batch, so sub-questions that retrieve the same figure share its KV prefix; a final
text-only prompt synthesises the sub-answers. Every step is async; nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from core.engine import Engine, ImageTokenCounts, Layout, PromptPlan, SamplingSpec, Submit, Usage
from rag.answer import Answer, Citation
from rag.decompose import Decomposer
from rag.order import canonical_order
from retrieval.search import Hit, PageSearcher

NO_PAGES_ANSWER = "No relevant pages were found in the ingested documents for this question."


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
    return [Citation(h.page_id, h.doc, h.page, h.score, str(h.image_key)) for h in ranked]


def synthesis_plan(question: str, sub_questions: Sequence[str], answers: Sequence[str], max_tokens: int
                   ) -> PromptPlan:
    lines = [f"Question: {question}"]
    lines += [f"Sub-question {i}: {q}\nAnswer {i}: {a.strip()}" for i, (q, a) in enumerate(zip(sub_questions, answers), 1)]
    return PromptPlan(images=(), text="\n".join(lines), system_prompt_id="synthesize",
                      sampling=SamplingSpec(max_tokens=max_tokens))


class Pipeline:
    """``submit`` is where plans go (the scheduler's submit when serving; ``engine.generate`` by default);
    ``token_counts`` is filled from retrieval payloads, for a scheduler that admits by image tokens."""

    def __init__(self, decomposer: Decomposer, searcher: PageSearcher, engine: Engine, *,
                 config: PipelineConfig = PipelineConfig(), submit: Submit | None = None,
                 token_counts: ImageTokenCounts | None = None) -> None:
        self.decomposer = decomposer
        self.searcher = searcher
        self.engine = engine
        self.config = config
        self.submit = submit or engine.generate
        self.token_counts = token_counts if token_counts is not None else ImageTokenCounts()

    async def ask(self, question: str, *, docs: list[str] | None = None) -> Answer:
        decomposition = await self.decomposer.decompose(question)
        subs = decomposition.sub_questions
        hits = await self.searcher.search_many(subs, doc_filter=docs, top_k=self.config.top_k)
        usage = Usage()
        if not any(hits):
            return self._answer(NO_PAGES_ANSWER, decomposition, [], usage)
        for hit in (h for hs in hits for h in hs):
            self.token_counts.record(hit.image_key, hit.image_tokens)
        plans = build_plans(subs, hits, max_tokens=self.config.max_tokens, layout=self.config.layout)
        completions = await _all(self.submit(p) for p in plans)
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


async def _all(awaitables) -> list:
    """``gather``, except that one failure cancels the siblings: an answer that cannot be given leaves no
    plans behind in the queue or the engine. (A cancelled ``gather`` already cancels its children.)"""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
