"""The RAG pipeline: question → sub-questions → pages per sub-question → prompt plans → cited answer.

The layout (``PipelineConfig.layout``, MMRAG_LAYOUT) decides the plans; all of them are exact (the model
sees the full pages, nothing is approximated), they differ in which prompt prefixes recur:

- canonical: one plan per sub-question (its pages + the sub-question), pages in the canonical order of the
  batch, so sub-questions that retrieve the same figure share its KV prefix;
- global: the same plans, pages in the process-wide popularity order (rag/order.PagePopularity), so a pair
  of pages renders the same way across requests and the second page hits wherever the pair recurs;
- per_page: one plan per (sub-question, page), each starting with its page, so every page leads a prompt
  and every reuse of a page can hit;
- naive (the benchmark's baseline): pages in retrieval-score order, the question before them.

A final text-only prompt synthesises the sub-answers. Every step is async; nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

from core.engine import Engine, ImageTokenCounts, Layout, PromptPlan, SamplingSpec, Submit, Usage
from core.keys import ImageKey
from rag.answer import Answer, Citation
from rag.decompose import Decomposer
from rag.order import PagePopularity, canonical_order
from retrieval.search import Hit, PageSearcher

NO_PAGES_ANSWER = "No relevant pages were found in the ingested documents for this question."


@dataclass(slots=True, frozen=True)
class PipelineConfig:
    top_k: int = 3  # pages per sub-question
    max_tokens: int = 128
    layout: Layout = Layout.CANONICAL


@dataclass(slots=True, frozen=True)
class PlannedPrompt:
    """One plan and what the synthesis needs to label its answer."""

    plan: PromptPlan
    sub_question: int  # index into the sub-questions
    page: Hit | None = None  # per-page layout: the page the plan is about


def plan_prompts(sub_questions: Sequence[str], hits: Sequence[Sequence[Hit]], *, max_tokens: int,
                 layout: Layout = Layout.CANONICAL, popularity: PagePopularity | None = None
                 ) -> list[PlannedPrompt]:
    """The plans of one question, in sub-question order; a sub-question without pages gets none.

    Per-page layout: one plan per (sub-question, distinct page), pages in retrieval-score order. It changes
    what the model sees: no prompt shows two pages together, so a comparison across pages happens only in
    the synthesis, from the sub-answers' text; and it costs a request and its decode tokens per page
    instead of per sub-question (plus the synthesis, now even for a one-sub-question question with several
    pages).

    ``popularity`` (the global layout only, where it is required) is read, not updated: the caller observes
    each sub-question's pages first (``Pipeline.ask`` does), so the order includes this question.
    """
    sampling = SamplingSpec(max_tokens=max_tokens)
    if layout is Layout.PER_PAGE:
        return [PlannedPrompt(PromptPlan(images=(h.image_key,), text=q, sampling=sampling, layout=layout), i, h)
                for i, (q, hs) in enumerate(zip(sub_questions, hits)) for h in _distinct_pages(hs)]
    keyed = [[h.image_key for h in hs] for hs in hits]
    if layout is Layout.CANONICAL:
        orders = canonical_order(keyed)
    elif layout is Layout.GLOBAL:
        if popularity is None:
            raise ValueError("the global layout orders pages by a PagePopularity: pass popularity=")
        orders = [popularity.order(k) for k in keyed]
    else:
        orders = [list(dict.fromkeys(k)) for k in keyed]
    return [PlannedPrompt(PromptPlan(images=tuple(order), text=q, sampling=sampling, layout=layout), i)
            for i, (q, order) in enumerate(zip(sub_questions, orders)) if order]


def _distinct_pages(hits: Sequence[Hit]) -> list[Hit]:
    """Each image key once, at its first (best-scored) hit: the same page in two documents is one prompt."""
    first: dict[ImageKey, Hit] = {}
    for hit in hits:
        first.setdefault(hit.image_key, hit)
    return list(first.values())


def build_plans(sub_questions: Sequence[str], hits: Sequence[Sequence[Hit]], *, max_tokens: int,
                layout: Layout = Layout.CANONICAL, popularity: PagePopularity | None = None) -> list[PromptPlan]:
    """The plain plans of :func:`plan_prompts` (what the benchmark replays)."""
    return [p.plan for p in plan_prompts(sub_questions, hits, max_tokens=max_tokens, layout=layout,
                                         popularity=popularity)]


def cite(hits: Sequence[Sequence[Hit]]) -> list[Citation]:
    """Every retrieved page once, with its best score, best first."""
    best: dict[tuple[str, int], Hit] = {}
    for hit in (h for hs in hits for h in hs):
        k = (hit.doc, hit.page)
        if k not in best or hit.score > best[k].score:
            best[k] = hit
    ranked = sorted(best.values(), key=lambda h: (-h.score, h.doc, h.page))
    return [Citation(h.page_id, h.doc, h.page, h.score, str(h.image_key)) for h in ranked]


def synthesis_plan(question: str, planned: Sequence[PlannedPrompt], answers: Sequence[str], max_tokens: int
                   ) -> PromptPlan:
    """One text prompt over the sub-answers, numbered by sub-question; a per-page answer names its page
    (``Answer 1 from [doc.pdf, page 3]: ...``), the form the answers cite pages in."""
    lines = [f"Question: {question}"]
    for i, (_, group) in enumerate(groupby(zip(planned, answers), key=lambda row: row[0].sub_question), 1):
        rows = list(group)
        lines.append(f"Sub-question {i}: {rows[0][0].plan.text}")
        lines += [f"Answer {i}{_source(p.page)}: {a.strip()}" for p, a in rows]
    return PromptPlan(images=(), text="\n".join(lines), system_prompt_id="synthesize",
                      sampling=SamplingSpec(max_tokens=max_tokens))


def _source(page: Hit | None) -> str:
    return f" from [{page.doc}, page {page.page}]" if page is not None else ""


class Pipeline:
    """``submit`` is where plans go (the scheduler's submit when serving; ``engine.generate`` by default);
    ``token_counts`` is filled from retrieval payloads, for a scheduler that admits by image tokens.

    With the global layout the pipeline holds the process's one :class:`PagePopularity` (the wiring builds
    one pipeline per process) and observes every sub-question's retrieved pages before planning.
    """

    def __init__(self, decomposer: Decomposer, searcher: PageSearcher, engine: Engine, *,
                 config: PipelineConfig = PipelineConfig(), submit: Submit | None = None,
                 token_counts: ImageTokenCounts | None = None) -> None:
        self.decomposer = decomposer
        self.searcher = searcher
        self.engine = engine
        self.config = config
        self.submit = submit or engine.generate
        self.token_counts = token_counts if token_counts is not None else ImageTokenCounts()
        self.popularity: PagePopularity | None = PagePopularity() if config.layout is Layout.GLOBAL else None

    async def ask(self, question: str, *, docs: list[str] | None = None) -> Answer:
        clock = _Stages()
        decomposition = await self.decomposer.decompose(question)
        clock.lap("decompose_s")
        subs = decomposition.sub_questions
        hits = await self.searcher.search_many(subs, doc_filter=docs, top_k=self.config.top_k)
        clock.lap("retrieve_s")
        usage = Usage()
        if not any(hits):
            return clock.stamp(self._answer(NO_PAGES_ANSWER, decomposition, [], usage))
        for hit in (h for hs in hits for h in hs):
            self.token_counts.record(hit.image_key, hit.image_tokens)
        if self.popularity is not None:
            for hs in hits:
                self.popularity.observe(h.image_key for h in hs)
        planned = plan_prompts(subs, hits, max_tokens=self.config.max_tokens, layout=self.config.layout,
                               popularity=self.popularity)
        completions = await _all(self.submit(p.plan) for p in planned)
        clock.lap("sub_answers_s")
        for c in completions:
            usage.add(c.usage)
        if len(completions) == 1:
            text = completions[0].text
        else:
            final = await self.submit(synthesis_plan(question, planned, [c.text for c in completions],
                                                     self.config.max_tokens))
            usage.add(final.usage)
            text = final.text
            clock.lap("synthesis_s")
        answer = self._answer(text, decomposition, cite(hits), usage)
        answer.extra["sub_answers"] = [
            {"sub_question": p.plan.text, "answer": c.text,
             **({"page": f"[{p.page.doc}, page {p.page.page}]"} if p.page is not None else {})}
            for p, c in zip(planned, completions)
        ]
        return clock.stamp(answer)

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


class _Stages:
    """Wall time per stage of one answer, in the order they ran (queueing in the scheduler included in the
    stage whose plans waited): what `answer.extra["timings"]` reports."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(now - self._last, 4)
        self._last = now

    def stamp(self, answer: Answer) -> Answer:
        answer.extra["timings"] = self.seconds
        return answer


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
