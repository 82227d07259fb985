"""The RAG pipeline: question → sub-questions → pages → prompt plans (rag/plans.py) → cited answer.

The strategy (``PipelineConfig.answer_mode``, MMRAG_ANSWER_MODE; per question ``answer_mode``): ``auto`` chooses
per question between **split** (every shown page leads a prompt of its own, with the parts of the question that
found it; the parts are one answer) and **joint** (one prompt over the pages, for a question that relates them;
when it does not fit one prompt, a prompt per sub-question and a synthesis). rag/plans.py says which rule
chooses what, and what each costs and shows; the answer's ``answer_mode_reason`` says which rule chose. Every
step is async; nothing here blocks the event loop.

Streaming (``Pipeline.ask_events``, what `POST /v1/ask` with `"stream": true` sends as server-sent events): the
same ``ask``, telling each step as it happens, as JSON-ready dicts —
``{"event": "sub_questions", "sub_questions", "sub_question_source"}``, ``{"event": "citations", "citations",
"answer_mode"}``, in joint's overflow only ``{"event": "sub_answer", "sub_question", "answer", "page"?}`` as
each plan finishes, ``{"event": "token", "text"}`` per piece of the answer as it is generated (the joint prompt's
answer or the synthesis; a split answer's parts in their final order, each part's heading first, the first part
live from its first token and each later part from where it has got to once the parts before it are done: they
decode side by side), and last ``{"event": "done", "answer": <Answer.to_json()>}``; the tokens concatenate to
its ``answer``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from mmrag.core.engine import Completion, Engine, ImageTokenCounts, Layout, PromptPlan, Submit, Usage
from mmrag.core.keys import ImageKey, KeyLease, NoLease
from mmrag.core.settings import DEFAULT_TENANT, default_of
from rag.answer import Answer, Citation
from rag.answer_cache import AnswerCache, CachedAnswer, answer_key
from rag.decompose import Decomposer
from rag.plans import (JOINT_PART_MIN_TOKENS, AnswerChoice, AnswerMode, PlannedPrompt, choice_plans, choose_answer, cite, fit_pages,
                       image_label,
                       joint_text, page_label, part_heading, plan_prompts, shown_as_figures, synthesis_plan)
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
    """Each default is the setting's (mmrag/core/settings.py, declared once there)."""

    top_k: int = default_of("top_k")  # pages per sub-question
    max_tokens: int = default_of("answer_max_tokens")  # the answer's (all its parts); a question may ask fewer
    max_images_per_prompt: int = default_of("max_images_per_prompt")  # a question's own images and its pages
    answer_mode: AnswerMode = AnswerMode(default_of("answer_mode"))
    sub_answer_max_tokens: int = default_of("sub_answer_max_tokens")  # joint's overflow: each sub-answer's
    max_model_len: int = default_of("max_model_len")  # the engine's context: one prompt and its answer fit in it
    one_prompt_pages: int = default_of("one_prompt_pages")  # most pages an answer shows (0: every page)
    figure_crops: bool = default_of("figure_crops")  # a hit on a figure shows its crop, not its page
    # A joint answer's shortest part (rag/plans.joint_parts): a shorter answer is one prompt. Not a setting: tests
    # of the parts' mechanics lower it to see parts at a few tokens.
    joint_part_min_tokens: int = JOINT_PART_MIN_TOKENS
    # Benchmarks only: every answer plan decodes exactly its max_tokens. A random-weight model stops at an end of
    # sequence wherever it happens to draw one, so answers of one length would differ by side and by mode.
    fixed_length: bool = default_of("answer_fixed_length")


class Pipeline:
    """``submit`` is where plans go (the scheduler's submit when serving; ``engine.generate`` by default);
    ``token_counts`` is filled from retrieval payloads, for a scheduler that admits by image tokens.

    The wiring builds one pipeline per tenant scope (mmrag/core/scope.py): ``searcher`` reads the tenant's collection,
    ``cache_salt`` goes on every plan it submits.

    ``tiers``: where a question that asks for a resolution tier gets its pages' tokens in it (rag/tiers.py).

    ``answers``: the answer cache (rag/answer_cache.py; None: off), keyed with ``tenant`` and ``prompt_version``
    (what the wiring hashes of the system prompts, the prompt templates and the settings that shape prompts): a
    greedy answer whose key was answered before is served from it, streamed as it was, with no engine request;
    ``usage.answer_cache`` says ``hit``, ``miss`` or ``off``.

    ``lease``: a new lease per answer (mmrag/core/keys.py KeyLease), on the pages it shows from retrieval to its last
    token, so a document deleted meanwhile (or ``mmrag store gc``) takes its pages' tokens away only after the
    answer ends. A page whose tokens went before the lease began (deleted between retrieval and planning) is
    left out of the answer, as if it had not been retrieved, and named in ``pages_deleted``.
    """

    def __init__(self, decomposer: Decomposer, searcher: PageSearcher, engine: Engine, *,
                 config: PipelineConfig = PipelineConfig(), submit: Submit | None = None,
                 token_counts: ImageTokenCounts | None = None, tiers: TierSource | None = None,
                 cache_salt: str = "", lease: Callable[[], KeyLease] = NoLease, answers: AnswerCache | None = None,
                 tenant: str = DEFAULT_TENANT, prompt_version: str = "") -> None:
        self.decomposer = decomposer
        self.searcher = searcher
        self.engine = engine
        self.config = config
        self.submit = submit or engine.generate
        self.token_counts = token_counts if token_counts is not None else ImageTokenCounts()
        self.tiers = tiers
        self.cache_salt = cache_salt  # the tenant's (mmrag/core/scope.py): on every plan this pipeline submits
        self.lease = lease
        self.answers = answers
        self.tenant = tenant
        self.prompt_version = prompt_version

    def ask_events(self, question: str, *, docs: list[str] | None = None, images: Sequence[ImageKey] = (),
                   tier: str | None = None, answer_mode: AnswerMode | str | None = None,
                   max_tokens: int | None = None, temperature: float = 0.0) -> AsyncIterator[dict]:
        """:meth:`ask`'s steps as events, then its answer (module docstring); closing the iterator early (its
        client left) cancels the question, its plans and their engine requests with it."""
        return stream_events(lambda emit: self.ask(question, docs=docs, images=images, tier=tier, on_event=emit,
                                                   answer_mode=answer_mode, max_tokens=max_tokens,
                                                   temperature=temperature))

    async def ask(self, question: str, *, docs: list[str] | None = None, images: Sequence[ImageKey] = (),
                  tier: str | None = None, on_event: Emit | None = None, answer_mode: AnswerMode | str | None = None,
                  max_tokens: int | None = None, temperature: float = 0.0) -> Answer:
        """``images``: the question's own images, already in the feature store, their token counts recorded
        in ``token_counts``; retrieval still runs on the text alone. ``tier``: show the pages in that
        resolution tier (None: as indexed, the standard tier); the question's images stay as they are.
        ``answer_mode``: this question's (None: the configured one). ``max_tokens``: the answer's length, at
        most the configured one (None: that). ``temperature``: the answer plans' (0: greedy, the default; above
        0 the answer is sampled, and never served from or kept in the answer cache). ``on_event`` is told each
        step as it happens, all but the final ``done`` (:meth:`ask_events`)."""
        requested = AnswerMode(answer_mode) if answer_mode is not None else self.config.answer_mode
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        limit = min(max_tokens or self.config.max_tokens, self.config.max_tokens)
        if tier is not None:
            if self.tiers is None:
                raise ValueError("this pipeline was built without resolution tiers: build it with tiers=")
            self.tiers.check(tier)  # before any work: an unknown tier fails at once
        if temperature < 0:
            raise ValueError(f"temperature must be at least 0, got {temperature}")
        run = _Run(question, on_event, _Stages(), temperature=temperature, docs=docs, tier=tier)
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
        """The answer over ``hits`` (each sub-question's pages) and ``images``, by the strategy chosen for them."""
        subs = decomposition.sub_questions
        choice = choose_answer(requested, hits, question=question, relates=decomposition.relates, images=images,
                               max_pages=self.config.one_prompt_pages, max_parts=limit,
                               misfit=lambda pages: self._misfit(question, subs, pages, hits, images, limit))
        if choice.left_out:  # not shown (no room, or past the page budget): neither shown nor cited
            dropped = {p.image_key for p in choice.left_out}
            cut += [h for hs in hits for h in hs if h.image_key in dropped]
            hits = [[h for h in hs if h.image_key not in dropped] for hs in hits]
        citations = cite(hits)
        run.emit({"event": "citations", "answer_mode": choice.mode.value,
                  "citations": self._answer("", decomposition, citations, usage).to_json()["citations"]})
        key = self._answer_key(run, decomposition, choice, hits, citations, images, limit)
        if key is not None and (cached := await self.answers.get(self.tenant, key)) is not None:
            return self._replay(run, cached, decomposition, citations)
        extra: dict = {"answer_mode": choice.mode.value, "answer_mode_reason": choice.why}
        if choice.overflow:
            text, extra["sub_answers"] = await self._per_sub_question(run, subs, hits, images, limit, usage)
        else:
            text, parts = await self._parts(run, subs, choice, hits, images, limit, usage)
            if parts:
                extra["image_answers"] = parts
        answer = self._answer(text, decomposition, citations, usage)
        answer.extra.update(extra)
        shown = {(c.doc, c.page) for c in citations}
        if left_out := [c for c in cite([cut]) if (c.doc, c.page) not in shown]:
            answer.extra["pages_left_out"] = [page_label(c) for c in left_out]
        if key is not None:
            answer.answer_cache = "miss"
            await self.answers.put(self.tenant, key, CachedAnswer(run.pieces if run.streamed else [text],
                                                                  answer.to_json()))
        return answer

    def _answer_key(self, run: _Run, decomposition, choice: AnswerChoice, hits: list[list[Hit]],
                    citations: list[Citation], images: Sequence[ImageKey], limit: int) -> str | None:
        """The answer cache's key of this answer (rag/answer_cache.answer_key), or None when it is not looked up:
        no cache, or a sampled answer. The pages in prompt order: the joint prompt's, a split's parts', or (joint's
        overflow) each sub-question's."""
        if self.answers is None or run.temperature > 0:
            return None
        pages = ([p.image_key for p in choice.pages] if not choice.overflow else
                 [h.image_key for hs in hits for h in hs])
        return answer_key(tenant=self.tenant, question=run.question, images=images,
                          sub_questions=decomposition.sub_questions, pages=pages,
                          page_ids=[c.page_id for c in citations], model=self.engine.model_name,
                          prompt_version=self.prompt_version, strategy=choice.mode.value, max_tokens=limit,
                          docs=run.docs, tier=run.tier)

    def _replay(self, run: _Run, cached: CachedAnswer, decomposition, citations: list[Citation]) -> Answer:
        """The answer kept under this question's key, streamed as it was: its text pieces, its strategy and its
        parts; its citations are this question's (the key holds their ids); its usage is this request's: no
        engine work."""
        for piece in cached.deltas:
            run.text(piece)
        run.clock.lap("answer_s")
        kept = cached.answer
        answer = self._answer(str(kept.get("answer", "")), decomposition, citations, Usage())
        answer.answer_cache = "hit"
        answer.extra.update({k: kept[k] for k in _REPLAYED if k in kept})
        return answer

    async def _pages(self, retrieved: list[list[Hit]], question: str, subs: Sequence[str],
                     images: Sequence[ImageKey], tier: str | None, usage: Usage
                     ) -> tuple[list[list[Hit]], list[Hit], TieredHits | None]:
        """Each sub-question's pages that a prompt has room for beside the question's images (and those cut),
        in the asked tier (its on-demand encodes counted in ``usage``), their token counts recorded for the
        scheduler."""
        if self.config.figure_crops:
            retrieved = shown_as_figures(retrieved, subs, whole=question)
        hits, cut = fit_pages(retrieved, room=self.config.max_images_per_prompt - len(images),
                              layout=Layout.CANONICAL)
        tiered = await self.tiers(hits, tier) if tier is not None and self.tiers is not None else None
        if tiered is not None:
            hits = tiered.hits
            usage.vision_encodes += tiered.vision_encodes
        for hit in (h for hs in hits for h in hs):
            self.token_counts.record(hit.image_key, hit.image_tokens)
        return hits, cut, tiered

    def _misfit(self, question: str, subs: Sequence[str], pages: Sequence[Hit], hits: list[list[Hit]],
                images: Sequence[ImageKey], max_tokens: int) -> str | None:
        """Why one prompt over ``pages`` (a joint prompt, or a split part's one page) would not fit the engine
        (None when it does): too many images, or its tokens with the answer's over the context. Text is counted
        as its UTF-8 bytes, which no byte-level BPE token count exceeds."""
        n = len(images) + len(pages)
        if n > self.config.max_images_per_prompt:
            return f"{n} images, over MMRAG_MAX_IMAGES_PER_PROMPT={self.config.max_images_per_prompt}"
        image_tokens = sum(p.image_tokens for p in pages) + self.token_counts.of_plan(PromptPlan(tuple(images), ""))
        text = len(joint_text(question, subs, pages, len(images), hits).encode())
        need = image_tokens + text + PROMPT_FRAME_TOKENS + max_tokens
        if need > self.config.max_model_len:
            return (f"{image_tokens} image tokens, up to {text + PROMPT_FRAME_TOKENS} of text and {max_tokens} of "
                    f"answer: over MMRAG_MAX_MODEL_LEN={self.config.max_model_len}")
        return None

    async def _parts(self, run: _Run, subs: Sequence[str], choice: AnswerChoice, hits: list[list[Hit]],
                     images: Sequence[ImageKey], max_tokens: int, usage: Usage) -> tuple[str, list[dict]]:
        """The choice's parts (rag/plans.choice_plans: a split's, or a joint answer's) at once, the answer's
        length shared among them (rag/plans.part_lengths); the answer is their parts in ``choice.pages`` order,
        each under its page's heading. Streamed in that order: the first part live from its first token, each
        later part from where it has got to once the parts before it are done, then live (they decode side by
        side); the answer's TTFT is the first part's. A lone plan is the answer, streamed as it comes."""
        planned = choice_plans(choice, run.question, subs, max_tokens=max_tokens, images=images, hits=hits,
                               min_part_tokens=self.config.joint_part_min_tokens)
        if len(planned) == 1:
            completion = await self._submit(planned[0].plan, run, streamed=True)
            usage.add(completion.usage)
            run.clock.lap("answer_s")
            return completion.text, []
        headings = [part_heading(p.page, i == 0) for i, p in enumerate(planned)]
        parts = [_Part(heading) for heading in headings]
        relay = _Relay(run, parts)

        async def part(i: int, p: PlannedPrompt) -> str:
            c = await self._submit(p.plan, run, on_text=relay.listener(i) if run.streamed else None)
            usage.add(c.usage)
            return c.text

        tasks = [asyncio.ensure_future(part(i, p)) for i, p in enumerate(planned)]
        try:
            texts = []
            for i, task in enumerate(tasks):
                texts.append(await task)
                relay.finish(i, texts[i])
        finally:  # a part failed, or the question was cancelled: the others go too, before the answer ends
            await _cancelled(tasks)
        run.clock.lap("answer_s")
        rows = [{"page": image_label(p.page, in_prompt=False), "image": str(p.page.image_key), "answer": text}
                for p, text in zip(planned, texts)]
        return "".join(h + t for h, t in zip(headings, texts)), rows

    async def _per_sub_question(self, run: _Run, subs: Sequence[str], hits: list[list[Hit]],
                                images: Sequence[ImageKey], max_tokens: int, usage: Usage) -> tuple[str, list[dict]]:
        """Joint's overflow: each sub-question's plan answered at once (each within the sub-answer length),
        then one synthesis over their answers; a lone plan's answer is the answer, at the answer's length."""
        planned = plan_prompts(subs, hits, max_tokens=min(self.config.sub_answer_max_tokens, max_tokens),
                               images=images)
        only = len(planned) == 1
        if only:
            planned = [dataclasses.replace(planned[0], plan=_with_max_tokens(planned[0].plan, max_tokens))]

        async def sub_answer(p: PlannedPrompt) -> dict:
            c = await self._submit(p.plan, run, streamed=only)
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

    def _submit(self, plan: PromptPlan, run: _Run, *, streamed: bool = False, on_text: _Listener | None = None
                ) -> Awaitable[Completion]:
        """The plan submitted under the tenant's salt, at the question's temperature; its text streamed as the
        answer's tokens when ``streamed`` (it is the answer, or the synthesis) and the question is streamed, or
        a split part's to ``on_text`` (a submit that never streams, such as a test's recorder, need not take
        ``on_text``)."""
        plan = dataclasses.replace(plan, cache_salt=self.cache_salt)
        if run.temperature > 0:
            plan = dataclasses.replace(plan, sampling=dataclasses.replace(plan.sampling, temperature=run.temperature))
        if self.config.fixed_length:
            plan = dataclasses.replace(plan, sampling=dataclasses.replace(plan.sampling,
                                                                          min_tokens=plan.sampling.max_tokens))
        if on_text is not None:
            return self.submit(plan, on_text=on_text)
        if streamed and run.streamed:
            return self.submit(plan, on_text=run.text)
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


# What a cached answer brings back besides its text: how it was made (its citations and usage are the request's).
_REPLAYED = ("answer_mode", "answer_mode_reason", "image_answers", "sub_answers", "pages_left_out")


def _with_max_tokens(plan: PromptPlan, max_tokens: int) -> PromptPlan:
    return dataclasses.replace(plan, sampling=dataclasses.replace(plan.sampling, max_tokens=max_tokens))


class _Run:
    """One question being answered: its text, how it is asked (temperature, filters, tier), who hears its
    events, the answer's text pieces as they went out (what the answer cache keeps), and its stage clock."""

    def __init__(self, question: str, on_event: Emit | None, clock: _Stages, *, temperature: float = 0.0,
                 docs: list[str] | None = None, tier: str | None = None) -> None:
        self.question = question
        self.streamed = on_event is not None
        self._on_event = on_event or (lambda event: None)
        self.clock = clock
        self.temperature = temperature
        self.docs = docs
        self.tier = tier
        self.pieces: list[str] = []

    def emit(self, event: dict) -> None:
        self._on_event(event)

    def text(self, delta: str) -> None:
        self.pieces.append(delta)
        self._on_event({"event": "token", "text": delta})


_Listener = Callable[[str], None]  # a split part's text pieces as the engine streams them


@dataclass(slots=True)
class _Part:
    """One split part as it streams: its heading and what it has generated so far."""

    heading: str
    pieces: list[str] = dataclasses.field(default_factory=list)


class _Relay:
    """A split answer's parts streamed as one answer, in their final order: the current part's pieces go out as
    they come; a later part's wait in its buffer until every part before it is done, then go out at once, and
    its next ones live. The heading of a part goes out before its first piece (the first part's at once)."""

    def __init__(self, run: _Run, parts: list[_Part]) -> None:
        self.run = run
        self.parts = parts
        self.current = 0  # the part being streamed live
        if run.streamed and parts:
            run.text(parts[0].heading)

    def listener(self, i: int) -> _Listener:
        def on_text(piece: str) -> None:
            self.parts[i].pieces.append(piece)
            if i == self.current:
                self.run.text(piece)
        return on_text

    def finish(self, i: int, text: str) -> None:
        """Part ``i`` is done with ``text`` (every part before it is done too): what it generated beyond what
        was streamed goes out, then the next part catches up to where it has got."""
        if not self.run.streamed:
            return
        streamed = "".join(self.parts[i].pieces)
        if text.startswith(streamed) and len(text) > len(streamed):
            self.run.text(text[len(streamed):])  # a submit that gave the text only at the end
        self.current = i + 1
        if self.current < len(self.parts):
            nxt = self.parts[self.current]
            self.run.text(nxt.heading + "".join(nxt.pieces))


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
        await _cancelled(tasks)
        raise


async def _cancelled(tasks: Sequence[asyncio.Future]) -> None:
    """``tasks`` cancelled (those not done) and finished before this returns, even if the caller is cancelled
    meanwhile (then that is raised after): an answer that ends leaves no plan of its own in the scheduler or
    the engine, which a client that left, or one failed part, would otherwise leave behind for a while."""
    for task in tasks:
        task.cancel()
    pending = [t for t in tasks if not t.done()]
    interrupted = False
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            interrupted = True
        pending = [t for t in pending if not t.done()]
    for task in tasks:  # retrieved, so that none is logged as never retrieved
        if not task.cancelled():
            task.exception()
    if interrupted:
        raise asyncio.CancelledError
