"""The RAG pipeline: question → sub-questions → pages → prompt plans (rag/plans.py) → cited answer.

The answer mode (``PipelineConfig.answer_mode``, MMRAG_ANSWER_MODE; per question ``answer_mode``) decides
whether one prompt answers over the union of the sub-questions' pages, each of those pages leads a prompt of
its own and the parts are joined (per image), or each sub-question gets a prompt and a synthesis combines them
(rag/plans.py says what each costs and shows). The layout shapes the
per-sub-question plans. Every step is async; nothing here blocks the event loop.

Streaming (``Pipeline.ask_events``, what `POST /v1/ask` with `"stream": true` sends as server-sent events): the
same ``ask``, telling each step as it happens, as JSON-ready dicts —
``{"event": "sub_questions", "sub_questions", "sub_question_source"}``, ``{"event": "citations", "citations",
"answer_mode"}``, per sub-question only ``{"event": "sub_answer", "sub_question", "answer", "page"?}`` as each
plan finishes, ``{"event": "token", "text"}`` per piece of the final answer as it is generated (the one prompt's
answer, the synthesis, or the one plan's answer when there is one; per image, the first part's tokens, then
each later part whole), and last ``{"event": "done", "answer":
<Answer.to_json()>}``; the tokens concatenate to its ``answer``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from core.engine import Completion, Engine, ImageTokenCounts, Layout, PromptPlan, Submit, Usage
from core.keys import ImageKey, KeyLease, NoLease
from rag.answer import Answer, Citation
from rag.decompose import Decomposer
from rag.order import PagePopularity
from rag.plans import (AnswerChoice, AnswerMode, PlannedPrompt, choose_answer, cite, fit_pages, one_prompt_plan,
                       image_label, part_heading, per_image_plans,
                       one_prompt_text, page_label, plan_prompts, shown_as_figures, synthesis_plan)
from rag.tiers import TieredHits, TierSource
from retrieval.search import Hit, PageSearcher

NO_PAGES_ANSWER = "No relevant pages were found in the ingested documents for this question."
# What a prompt takes besides its images and its text: the system prompt and the chat template. An upper bound
# (the default system prompt is 170 characters), so that a prompt said to fit one context does.
PROMPT_FRAME_TOKENS = 256

# Told each event of an answer as it happens (see the module docstring); returns at once.
Emit = Callable[[dict], None]


@dataclass(slots=True, frozen=True)
class PipelineConfig:
    top_k: int = 3  # pages per sub-question
    max_tokens: int = 128  # the answer's (one prompt's, synthesis', or a lone plan's); a question may ask fewer
    layout: Layout = Layout.CANONICAL
    max_images_per_prompt: int = 12  # the engine's limit: a question's own images and its pages together
    answer_mode: AnswerMode = AnswerMode.AUTO
    sub_answer_max_tokens: int = 64  # each sub-answer's, per sub-question: notes the synthesis reads
    max_model_len: int = 4096  # the engine's context: one prompt and its answer must fit in it
    one_prompt_pages: int = 4  # most pages one prompt shows, each sub-question's best first (0: every page)
    figure_crops: bool = False  # a hit on a figure shows the figure's crop, not its page (MMRAG_FIGURE_CROPS)
    # Benchmarks only: every answer plan decodes exactly its max_tokens. A random-weight model stops at an end of
    # sequence wherever it happens to draw one, so answers of one length would differ by side and by mode.
    fixed_length: bool = False


class Pipeline:
    """``submit`` is where plans go (the scheduler's submit when serving; ``engine.generate`` by default);
    ``token_counts`` is filled from retrieval payloads, for a scheduler that admits by image tokens.

    The wiring builds one pipeline per tenant scope (core/scope.py): ``searcher`` reads the tenant's collection,
    ``cache_salt`` goes on every plan it submits. Each holds its tenant's :class:`PagePopularity` and observes
    every sub-question's retrieved pages before planning: one prompt orders its pages by it, and so does the
    global layout.

    ``tiers``: where a question that asks for a resolution tier gets its pages' tokens in it (rag/tiers.py).

    ``lease``: a new lease per answer (core/keys.py KeyLease), on the pages it shows from retrieval to its last
    token, so a document deleted meanwhile (or ``mmrag store gc``) takes its pages' tokens away only after the
    answer ends. A page whose tokens went before the lease began (deleted between retrieval and planning) is
    left out of the answer, as if it had not been retrieved, and named in ``pages_deleted``.
    """

    def __init__(self, decomposer: Decomposer, searcher: PageSearcher, engine: Engine, *,
                 config: PipelineConfig = PipelineConfig(), submit: Submit | None = None,
                 token_counts: ImageTokenCounts | None = None, tiers: TierSource | None = None,
                 cache_salt: str = "", lease: Callable[[], KeyLease] = NoLease) -> None:
        self.decomposer = decomposer
        self.searcher = searcher
        self.engine = engine
        self.config = config
        self.submit = submit or engine.generate
        self.token_counts = token_counts if token_counts is not None else ImageTokenCounts()
        self.tiers = tiers
        self.cache_salt = cache_salt  # the tenant's (core/scope.py): on every plan this pipeline submits
        self.popularity: PagePopularity = PagePopularity()
        self.lease = lease

    def ask_events(self, question: str, *, docs: list[str] | None = None, images: Sequence[ImageKey] = (),
                   tier: str | None = None, answer_mode: AnswerMode | str | None = None,
                   max_tokens: int | None = None) -> AsyncIterator[dict]:
        """:meth:`ask`'s steps as events, then its answer (module docstring); closing the iterator early (its
        client left) cancels the question, its plans and their engine requests with it."""
        return stream_events(lambda emit: self.ask(question, docs=docs, images=images, tier=tier, on_event=emit,
                                                   answer_mode=answer_mode, max_tokens=max_tokens))

    async def ask(self, question: str, *, docs: list[str] | None = None, images: Sequence[ImageKey] = (),
                  tier: str | None = None, on_event: Emit | None = None, answer_mode: AnswerMode | str | None = None,
                  max_tokens: int | None = None) -> Answer:
        """``images``: the question's own images, already in the feature store, their token counts recorded
        in ``token_counts``; retrieval still runs on the text alone. ``tier``: show the pages in that
        resolution tier (None: as indexed, the standard tier); the question's images stay as they are.
        ``answer_mode``: this question's (None: the configured one). ``max_tokens``: the answer's length, at
        most the configured one (None: that). ``on_event`` is told each step as it happens, all but the final
        ``done`` (:meth:`ask_events`)."""
        requested = AnswerMode(answer_mode) if answer_mode is not None else self.config.answer_mode
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        limit = min(max_tokens or self.config.max_tokens, self.config.max_tokens)
        if tier is not None:
            if self.tiers is None:
                raise ValueError("this pipeline was built without resolution tiers: build it with tiers=")
            self.tiers.check(tier)  # before any work: an unknown tier fails at once
        run = _Run(question, on_event, _Stages())
        decomposition = await self.decomposer.decompose(question)
        run.clock.lap("decompose_s")
        subs = decomposition.sub_questions
        run.emit({"event": "sub_questions", "sub_questions": subs, "sub_question_source": decomposition.source})
        # A split question's sub-questions lean on the whole question (retrieval/search.py, ``context``).
        retrieved = await self.searcher.search_many(subs, doc_filter=docs, top_k=self.config.top_k,
                                                    context=question if len(subs) > 1 else None)
        run.clock.lap("retrieve_s")
        if not any(retrieved) and not images:
            return run.clock.stamp(self._no_pages(run, decomposition, Usage()))
        usage = Usage()
        hits, cut, tiered = await self._pages(retrieved, question, subs, images, tier, usage)
        lease = self.lease()
        try:
            gone = await asyncio.to_thread(lease.take, {h.image_key for hs in hits for h in hs})
            if gone:  # deleted since retrieval: left out, as if not retrieved
                deleted = [h for hs in hits for h in hs if h.image_key in gone]
                hits = [[h for h in hs if h.image_key not in gone] for hs in hits]
            if any(hits) or images:
                answer = await self._answer_over(run, question, decomposition, hits, cut, images, requested, limit,
                                                 usage)
            else:  # every page it found was deleted meanwhile
                answer = self._no_pages(run, decomposition, usage)
            if gone:
                answer.extra["pages_deleted"] = sorted({page_label(c) for c in cite([deleted])})
        finally:
            await asyncio.to_thread(lease.end)
        if tiered is not None:
            answer.extra["tier"] = {"name": tier, "fell_back": tiered.fell_back}
        return run.clock.stamp(answer)

    def _no_pages(self, run: _Run, decomposition, usage: Usage) -> Answer:
        """The answer when no page is left to show: no citations, and NO_PAGES_ANSWER as its text."""
        run.emit({"event": "citations", "citations": []})
        run.text(NO_PAGES_ANSWER)
        return self._answer(NO_PAGES_ANSWER, decomposition, [], usage)

    async def _answer_over(self, run: _Run, question: str, decomposition, hits: list[list[Hit]], cut: list[Hit],
                           images: Sequence[ImageKey], requested: AnswerMode, limit: int, usage: Usage) -> Answer:
        """The answer over ``hits`` (each sub-question's pages) and ``images``, in the mode chosen for them."""
        subs = decomposition.sub_questions
        choice = choose_answer(requested, hits, popularity=self.popularity, layout=self.config.layout,
                               images=images, max_pages=self.config.one_prompt_pages,
                               misfit=lambda pages: self._misfit(question, subs, pages, hits, images, limit))
        if choice.left_out:  # one prompt had no room for them: neither shown nor cited
            dropped = {p.image_key for p in choice.left_out}
            cut += [h for hs in hits for h in hs if h.image_key in dropped]
            hits = [[h for h in hs if h.image_key not in dropped] for hs in hits]
        citations = cite(hits)
        run.emit({"event": "citations", "answer_mode": choice.mode.value,
                  "citations": self._answer("", decomposition, citations, usage).to_json()["citations"]})
        extra: dict = {"answer_mode": choice.mode.value, **({"answer_mode_reason": choice.why} if choice.why else {})}
        if choice.mode is AnswerMode.ONE_PROMPT:
            text = await self._one_prompt(run, subs, choice, hits, images, limit, usage)
        elif choice.mode is AnswerMode.PER_IMAGE:
            text, extra["image_answers"] = await self._per_image(run, subs, choice, hits, images, limit, usage)
        else:
            text, extra["sub_answers"] = await self._per_sub_question(run, subs, hits, images, limit, usage)
        answer = self._answer(text, decomposition, citations, usage)
        answer.extra.update(extra)
        shown = {(c.doc, c.page) for c in citations}
        if left_out := [c for c in cite([cut]) if (c.doc, c.page) not in shown]:
            answer.extra["pages_left_out"] = [page_label(c) for c in left_out]
        return answer

    async def _pages(self, retrieved: list[list[Hit]], question: str, subs: Sequence[str],
                     images: Sequence[ImageKey], tier: str | None, usage: Usage
                     ) -> tuple[list[list[Hit]], list[Hit], TieredHits | None]:
        """Each sub-question's pages that a prompt has room for beside the question's images (and those cut),
        in the asked tier (its on-demand encodes counted in ``usage``), their token counts recorded for the
        scheduler and their use counted in the popularity order."""
        if self.config.figure_crops:
            retrieved = shown_as_figures(retrieved, subs, whole=question)
        hits, cut = fit_pages(retrieved, room=self.config.max_images_per_prompt - len(images),
                              layout=self.config.layout)
        tiered = await self.tiers(hits, tier) if tier is not None and self.tiers is not None else None
        if tiered is not None:
            hits = tiered.hits
            usage.vision_encodes += tiered.vision_encodes
        for hit in (h for hs in hits for h in hs):
            self.token_counts.record(hit.image_key, hit.image_tokens)
        for hs in hits:
            self.popularity.observe(h.image_key for h in hs)
        return hits, cut, tiered

    def _misfit(self, question: str, subs: Sequence[str], pages: Sequence[Hit], hits: list[list[Hit]],
                images: Sequence[ImageKey], max_tokens: int) -> str | None:
        """Why one prompt over ``pages`` would not fit the engine (None when it does): too many images, or its
        tokens with the answer's over the context. Text is counted as its UTF-8 bytes, which no byte-level
        BPE token count exceeds."""
        n = len(images) + len(pages)
        if n > self.config.max_images_per_prompt:
            return f"{n} images, over MMRAG_MAX_IMAGES_PER_PROMPT={self.config.max_images_per_prompt}"
        image_tokens = sum(p.image_tokens for p in pages) + self.token_counts.of_plan(PromptPlan(tuple(images), ""))
        text = len(one_prompt_text(question, subs, pages, len(images), hits).encode())
        need = image_tokens + text + PROMPT_FRAME_TOKENS + max_tokens
        if need > self.config.max_model_len:
            return (f"{image_tokens} image tokens, up to {text + PROMPT_FRAME_TOKENS} of text and {max_tokens} of "
                    f"answer: over MMRAG_MAX_MODEL_LEN={self.config.max_model_len}")
        return None

    async def _one_prompt(self, run: _Run, subs: Sequence[str], choice: AnswerChoice, hits: list[list[Hit]],
                          images: Sequence[ImageKey], max_tokens: int, usage: Usage) -> str:
        plan = one_prompt_plan(run.question, subs, choice.pages, max_tokens=max_tokens, images=images, hits=hits)
        completion = await self._submit(plan, run)
        usage.add(completion.usage)
        run.clock.lap("answer_s")
        return completion.text

    async def _per_image(self, run: _Run, subs: Sequence[str], choice: AnswerChoice, hits: list[list[Hit]],
                         images: Sequence[ImageKey], max_tokens: int, usage: Usage) -> tuple[str, list[dict]]:
        """Each shown image's prompt at once, its share of the answer's length each; the answer is their parts
        in ``choice.pages`` order, each under its heading. Streamed: the first part as it is generated, then
        each later part whole once it and those before it are done (they decode side by side)."""
        planned = per_image_plans(run.question, subs, choice.pages, max_tokens=max_tokens, images=images, hits=hits)
        headings = [part_heading(p.page, i == 0) for i, p in enumerate(planned)]
        if run.streamed:
            run.text(headings[0])

        async def part(i: int, p: PlannedPrompt) -> str:
            c = await self._submit(p.plan, run if i == 0 else None)
            usage.add(c.usage)
            return c.text

        tasks = [asyncio.ensure_future(part(i, p)) for i, p in enumerate(planned)]
        try:
            parts = []
            for i, task in enumerate(tasks):
                parts.append(await task)
                if i and run.streamed:
                    run.text(headings[i] + parts[i])
        finally:
            for task in tasks:
                task.cancel()
        run.clock.lap("answer_s")
        rows = [{"page": image_label(p.page, in_prompt=False), "image": str(p.page.image_key), "answer": text}
                for p, text in zip(planned, parts)]
        return "".join(h + t for h, t in zip(headings, parts)), rows

    async def _per_sub_question(self, run: _Run, subs: Sequence[str], hits: list[list[Hit]],
                                images: Sequence[ImageKey], max_tokens: int, usage: Usage) -> tuple[str, list[dict]]:
        """Each sub-question's plans answered at once (each within the sub-answer length), then one synthesis
        over their answers; a lone plan's answer is the answer, at the answer's length."""
        planned = plan_prompts(subs, hits, max_tokens=min(self.config.sub_answer_max_tokens, max_tokens),
                               layout=self.config.layout, popularity=self.popularity, images=images)
        only = len(planned) == 1
        if only:
            planned = [dataclasses.replace(planned[0], plan=_with_max_tokens(planned[0].plan, max_tokens))]

        async def sub_answer(p: PlannedPrompt) -> dict:
            c = await self._submit(p.plan, run if only else None)
            usage.add(c.usage)
            row = {"sub_question": p.question, "answer": c.text,
                   **({"page": page_label(p.page)} if p.page is not None else {})}
            run.emit({"event": "sub_answer", **row})
            return row

        sub_answers = await _all(sub_answer(p) for p in planned)
        run.clock.lap("sub_answers_s")
        if only:
            return sub_answers[0]["answer"], sub_answers
        final = await self._submit(synthesis_plan(run.question, planned, [a["answer"] for a in sub_answers],
                                                  max_tokens), run)
        usage.add(final.usage)
        run.clock.lap("synthesis_s")
        return final.text, sub_answers

    def _submit(self, plan: PromptPlan, streamed_to: _Run | None) -> Awaitable[Completion]:
        """The plan submitted; its text streamed as the answer's tokens when it is the answer and the question
        is streamed (a submit that never streams, such as a test's recorder, need not take ``on_text``)."""
        plan = dataclasses.replace(plan, cache_salt=self.cache_salt)
        if self.config.fixed_length:
            plan = dataclasses.replace(plan, sampling=dataclasses.replace(plan.sampling,
                                                                          min_tokens=plan.sampling.max_tokens))
        if streamed_to is not None and streamed_to.streamed:
            return self.submit(plan, on_text=streamed_to.text)
        return self.submit(plan)

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


def _with_max_tokens(plan: PromptPlan, max_tokens: int) -> PromptPlan:
    return dataclasses.replace(plan, sampling=dataclasses.replace(plan.sampling, max_tokens=max_tokens))


class _Run:
    """One question being answered: its text, who hears its events, and its stage clock."""

    def __init__(self, question: str, on_event: Emit | None, clock: _Stages) -> None:
        self.question = question
        self.streamed = on_event is not None
        self._on_event = on_event or (lambda event: None)
        self.clock = clock

    def emit(self, event: dict) -> None:
        self._on_event(event)

    def text(self, delta: str) -> None:
        self._on_event({"event": "token", "text": delta})


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
