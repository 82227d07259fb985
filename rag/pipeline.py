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

Images sent with the question (``Pipeline.ask(images=...)``, already encoded and stored by the caller) lead
every prompt of that question in every layout, before its pages, so all its sub-questions share their KV;
pages make room for them, lowest score first, within ``max_images_per_prompt``.

A final text-only prompt synthesises the sub-answers. Every step is async; nothing here blocks the event loop.

Streaming (``Pipeline.ask_events``, what `POST /v1/ask` with `"stream": true` sends as server-sent events): the
same ``ask``, telling each step as it happens, as JSON-ready dicts —
``{"event": "sub_questions", "sub_questions", "sub_question_source"}``, ``{"event": "citations", "citations"}``,
``{"event": "sub_answer", "sub_question", "answer", "page"?}`` as each plan finishes, ``{"event": "token",
"text"}`` per piece of the final answer as it is generated (the synthesis, or the one plan's answer when there is
one), and last ``{"event": "done", "answer": <Answer.to_json()>}``; the tokens concatenate to its ``answer``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

from core.engine import Completion, Engine, ImageTokenCounts, Layout, PromptPlan, SamplingSpec, Submit, Usage
from core.keys import ImageKey
from rag.answer import Answer, Citation
from rag.decompose import Decomposer
from rag.order import PagePopularity, canonical_order
from rag.tiers import TierSource
from retrieval.search import Hit, PageSearcher

NO_PAGES_ANSWER = "No relevant pages were found in the ingested documents for this question."

# Told each event of an answer as it happens (see the module docstring); returns at once.
Emit = Callable[[dict], None]


@dataclass(slots=True, frozen=True)
class PipelineConfig:
    top_k: int = 3  # pages per sub-question
    max_tokens: int = 128
    layout: Layout = Layout.CANONICAL
    max_images_per_prompt: int = 4  # the engine's limit: a question's own images and its pages together


@dataclass(slots=True, frozen=True)
class PlannedPrompt:
    """One plan and what the synthesis needs to label its answer."""

    plan: PromptPlan
    sub_question: int  # index into the sub-questions
    page: Hit | None = None  # per-page layout: the page the plan is about


def plan_prompts(sub_questions: Sequence[str], hits: Sequence[Sequence[Hit]], *, max_tokens: int,
                 layout: Layout = Layout.CANONICAL, popularity: PagePopularity | None = None,
                 images: Sequence[ImageKey] = ()) -> list[PlannedPrompt]:
    """The plans of one question, in sub-question order; a sub-question without pages gets none, unless the
    question brought ``images``: those lead every plan (a page that is one of them is not shown twice).

    Per-page layout: one plan per (sub-question, distinct page), pages in retrieval-score order. It changes
    what the model sees: no prompt shows two pages together, so a comparison across pages happens only in
    the synthesis, from the sub-answers' text; and it costs a request and its decode tokens per page
    instead of per sub-question (plus the synthesis, now even for a one-sub-question question with several
    pages).

    ``popularity`` (the global layout only, where it is required) is read, not updated: the caller observes
    each sub-question's pages first (``Pipeline.ask`` does), so the order includes this question.
    """
    sampling = SamplingSpec(max_tokens=max_tokens)
    lead = tuple(images)

    def plan(i: int, pages: Sequence[ImageKey], page: Hit | None = None) -> PlannedPrompt:
        keys = tuple(dict.fromkeys((*lead, *pages)))
        return PlannedPrompt(PromptPlan(keys, sub_questions[i], sampling=sampling, layout=layout), i, page)

    if layout is Layout.PER_PAGE:
        planned = []
        for i, hs in enumerate(hits):
            if pages := _distinct_pages(hs):
                planned += [plan(i, (h.image_key,), h) for h in pages]
            elif lead:
                planned.append(plan(i, ()))
        return planned
    keyed = [[h.image_key for h in hs] for hs in hits]
    if layout is Layout.CANONICAL:
        orders = canonical_order(keyed)
    elif layout is Layout.GLOBAL:
        if popularity is None:
            raise ValueError("the global layout orders pages by a PagePopularity: pass popularity=")
        orders = [popularity.order(k) for k in keyed]
    else:
        orders = [list(dict.fromkeys(k)) for k in keyed]
    return [plan(i, order) for i, order in enumerate(orders) if order or lead]


def fit_pages(hits: Sequence[Sequence[Hit]], *, room: int, layout: Layout) -> tuple[list[list[Hit]], list[Hit]]:
    """Each sub-question's hits cut to the ``room`` best-scored distinct pages one prompt has left beside the
    question's own images, and the hits cut. A per-page prompt shows one page: any room fits them all."""
    if room < 0:
        raise ValueError(f"{-room} more question images than a prompt holds (MMRAG_MAX_IMAGES_PER_PROMPT)")
    if layout is Layout.PER_PAGE and room > 0:
        return [list(hs) for hs in hits], []
    shown: list[list[Hit]] = []
    cut: list[Hit] = []
    for hs in hits:
        best = {h.image_key for h in sorted(_distinct_pages(hs), key=lambda h: -h.score)[:room]}
        shown.append([h for h in hs if h.image_key in best])
        cut += [h for h in hs if h.image_key not in best]
    return shown, cut


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
    return f" from {_label(page)}" if page is not None else ""


def _label(page: Hit | Citation) -> str:
    """A page as answers cite it: ``[doc.pdf, page 3]``."""
    return f"[{page.doc}, page {page.page}]"


class Pipeline:
    """``submit`` is where plans go (the scheduler's submit when serving; ``engine.generate`` by default);
    ``token_counts`` is filled from retrieval payloads, for a scheduler that admits by image tokens.

    With the global layout the pipeline holds the process's one :class:`PagePopularity` (the wiring builds
    one pipeline per process) and observes every sub-question's retrieved pages before planning.

    ``tiers``: where a question that asks for a resolution tier gets its pages' tokens in it (rag/tiers.py).
    """

    def __init__(self, decomposer: Decomposer, searcher: PageSearcher, engine: Engine, *,
                 config: PipelineConfig = PipelineConfig(), submit: Submit | None = None,
                 token_counts: ImageTokenCounts | None = None, tiers: TierSource | None = None) -> None:
        self.decomposer = decomposer
        self.searcher = searcher
        self.engine = engine
        self.config = config
        self.submit = submit or engine.generate
        self.token_counts = token_counts if token_counts is not None else ImageTokenCounts()
        self.tiers = tiers
        self.popularity: PagePopularity | None = PagePopularity() if config.layout is Layout.GLOBAL else None

    def ask_events(self, question: str, *, docs: list[str] | None = None, images: Sequence[ImageKey] = (),
                   tier: str | None = None) -> AsyncIterator[dict]:
        """:meth:`ask`'s steps as events, then its answer (module docstring); closing the iterator early (its
        client left) cancels the question, its plans and their engine requests with it."""
        return stream_events(lambda emit: self.ask(question, docs=docs, images=images, tier=tier, on_event=emit))

    async def ask(self, question: str, *, docs: list[str] | None = None, images: Sequence[ImageKey] = (),
                  tier: str | None = None, on_event: Emit | None = None) -> Answer:
        """``images``: the question's own images, already in the feature store, their token counts recorded
        in ``token_counts``; retrieval still runs on the text alone. ``tier``: show the pages in that
        resolution tier (None: as indexed, the standard tier); the question's images stay as they are.
        ``on_event`` is told each step as it happens, all but the final ``done`` (:meth:`ask_events`)."""
        if tier is not None:
            if self.tiers is None:
                raise ValueError("this pipeline was built without resolution tiers: build it with tiers=")
            self.tiers.check(tier)  # before any work: an unknown tier fails at once
        streamed = on_event is not None
        on_event = on_event or (lambda event: None)
        clock = _Stages()
        decomposition = await self.decomposer.decompose(question)
        clock.lap("decompose_s")
        subs = decomposition.sub_questions
        on_event({"event": "sub_questions", "sub_questions": subs,
                  "sub_question_source": decomposition.source})
        retrieved = await self.searcher.search_many(subs, doc_filter=docs, top_k=self.config.top_k)
        clock.lap("retrieve_s")
        usage = Usage()

        def on_text(delta: str) -> None:
            on_event({"event": "token", "text": delta})

        if not any(retrieved) and not images:
            on_event({"event": "citations", "citations": []})
            on_text(NO_PAGES_ANSWER)
            return clock.stamp(self._answer(NO_PAGES_ANSWER, decomposition, [], usage))
        hits, cut = fit_pages(retrieved, room=self.config.max_images_per_prompt - len(images),
                              layout=self.config.layout)
        tiered = await self.tiers(hits, tier) if tier is not None and self.tiers is not None else None
        if tiered is not None:
            hits = tiered.hits
            usage.vision_encodes += tiered.vision_encodes
        for hit in (h for hs in hits for h in hs):
            self.token_counts.record(hit.image_key, hit.image_tokens)
        if self.popularity is not None:
            for hs in hits:
                self.popularity.observe(h.image_key for h in hs)
        planned = plan_prompts(subs, hits, max_tokens=self.config.max_tokens, layout=self.config.layout,
                               popularity=self.popularity, images=images)
        citations = cite(hits)
        on_event({"event": "citations",
                  "citations": self._answer("", decomposition, citations, usage).to_json()["citations"]})
        only = len(planned) == 1  # its answer is the answer: stream its tokens

        def submit(plan: PromptPlan, tokens: bool) -> Awaitable[Completion]:
            # on_text only when streaming: a submit that never streams (a test's recorder) need not take it.
            return self.submit(plan, on_text=on_text) if tokens and streamed else self.submit(plan)

        async def sub_answer(p: PlannedPrompt) -> dict:
            c = await submit(p.plan, only)
            usage.add(c.usage)
            row = {"sub_question": p.plan.text, "answer": c.text,
                   **({"page": _label(p.page)} if p.page is not None else {})}
            on_event({"event": "sub_answer", **row})
            return row

        sub_answers = await _all(sub_answer(p) for p in planned)
        clock.lap("sub_answers_s")
        if only:
            text = sub_answers[0]["answer"]
        else:
            final = await submit(synthesis_plan(question, planned, [a["answer"] for a in sub_answers],
                                                self.config.max_tokens), True)
            usage.add(final.usage)
            text = final.text
            clock.lap("synthesis_s")
        answer = self._answer(text, decomposition, citations, usage)
        answer.extra["sub_answers"] = sub_answers
        shown = {(c.doc, c.page) for c in citations}
        if left_out := [c for c in cite([cut]) if (c.doc, c.page) not in shown]:
            answer.extra["pages_left_out"] = [_label(c) for c in left_out]
        if tiered is not None:
            answer.extra["tier"] = {"name": tier, "fell_back": tiered.fell_back}
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


async def stream_events(run: Callable[[Emit], Awaitable[Answer]], *,
                        stop: Callable[[asyncio.Task], object] = asyncio.Task.cancel) -> AsyncIterator[dict]:
    """The events ``run(emit)`` emits, as they come, then ``{"event": "done", "answer": ...}`` with its
    answer; its error, raised. Closing the iterator before the end stops the run: ``stop(task)``, by default
    its cancellation (a caller that accounts for cancellations itself passes its own)."""
    events: asyncio.Queue[dict | None] = asyncio.Queue()
    task = asyncio.ensure_future(run(events.put_nowait))
    task.add_done_callback(lambda _: events.put_nowait(None))  # after every event it emitted
    try:
        while (event := await events.get()) is not None:
            yield event
    finally:
        if not task.done():
            stop(task)  # nothing awaited here: a cancelled consumer may not await again
    yield {"event": "done", "answer": task.result().to_json()}


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
