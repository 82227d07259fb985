"""How a question's retrieved pages become prompt plans: pure functions over hits, testable without an engine.

Two answer modes (:class:`AnswerMode`, MMRAG_ANSWER_MODE), both exact (the model sees whole pages, nothing is
approximated) and both citing every page they show:

- **one prompt** (:func:`choose_answer`, :func:`one_prompt_plan`): decomposition drives retrieval only. ONE
  prompt shows the union of the sub-questions' pages, each once, the pages asked most across questions first
  (rag/order.PagePopularity), then lists the pages by label, the sub-questions and the question. A figure two
  sub-questions share is prefilled once inside the prompt, with no cache lookup at all, and the answer is one
  decode: what a question costs is one request, as in a one-shot RAG, with its leading pages' KV from the
  prefix cache.
- **per sub-question** (:func:`plan_prompts`, :func:`synthesis_plan`): one plan per sub-question (or per page
  with the per_page layout), each sub-answer decoded, then a text-only synthesis decoded after all of them.
  Three sequential-ish decodes per question where one prompt has one; kept for what it gives a real model:
  a focused view of a few pages per sub-question.

``auto`` answers in one prompt when the union fits one (MMRAG_MAX_IMAGES_PER_PROMPT images, MMRAG_MAX_MODEL_LEN
tokens with the answer), and per sub-question when it does not.

The layouts (``Layout``) shape the per-sub-question plans: which prompt prefixes recur.

- canonical: one plan per sub-question (its pages + the sub-question), pages in the canonical order of the
  batch, so sub-questions that retrieve the same figure share its KV prefix;
- global: the same plans, pages in the process-wide popularity order (rag/order.PagePopularity), so a pair
  of pages renders the same way across requests and the second page hits wherever the pair recurs;
- per_page: one plan per (sub-question, page), each starting with its page, so every page leads a prompt
  and every reuse of a page can hit;
- naive (the benchmark's baseline): pages in retrieval-score order, the question before them.

Images sent with the question (already encoded and stored by the caller) lead every prompt of that question
in every mode and layout, before its pages; pages make room for them, lowest score first.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

from core.engine import Layout, PromptPlan, SamplingSpec
from core.figures import PageFigure
from core.keys import ImageKey
from core.text import figure_refs
from rag.answer import Citation
from rag.order import PagePopularity, canonical_order
from retrieval.search import Hit


class AnswerMode(str, enum.Enum):
    """How the retrieved pages become the answer (MMRAG_ANSWER_MODE; per question: ``answer_mode``)."""

    # One prompt when the union of the sub-questions' pages fits one, else per sub-question.
    AUTO = "auto"
    # One prompt over the union of the pages; pages that do not fit it are left out (lowest ranks first).
    ONE_PROMPT = "one_prompt"
    # One prompt per image one prompt would show, each image leading its own prompt, the answer's length shared
    # among them and their answers joined in order (no synthesis): every recurrence of an image hits its prefix.
    PER_IMAGE = "per_image"
    # One prompt per sub-question (or per page), then a synthesis over the sub-answers.
    PER_SUB_QUESTION = "per_sub_question"


@dataclass(slots=True, frozen=True)
class PlannedPrompt:
    """One plan and what the synthesis needs to label its answer."""

    plan: PromptPlan
    sub_question: int  # index into the sub-questions
    page: Hit | None = None  # per-page layout: the page the plan is about
    asked: str | None = None  # the sub-question, where the plan's text also says what its images are

    @property
    def question(self) -> str:
        """What this plan asks, as the sub-answers and the synthesis show it."""
        return self.plan.text if self.asked is None else self.asked


# --- one prompt --------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class AnswerChoice:
    """The mode that answers a question and, for one prompt, what it shows."""

    mode: AnswerMode  # ONE_PROMPT or PER_SUB_QUESTION, never AUTO
    pages: tuple[Hit, ...] = ()  # one prompt: its pages, in prompt order
    left_out: tuple[Hit, ...] = ()  # one prompt: retrieved pages it had no room for
    why: str = ""  # auto that answers per sub-question: why one prompt did not fit


# A candidate set of pages -> None when one prompt over them fits, else why not (for the answer to say).
Misfit = Callable[[Sequence[Hit]], str | None]


def union_pages(hits: Sequence[Sequence[Hit]], *, besides: Sequence[ImageKey] = ()) -> list[Hit]:
    """Every distinct page the sub-questions retrieved, once, ranked for keeping: each sub-question's best page
    first (in the sub-questions' order), then the others by how far each stands out from its own sub-question's
    candidates (``Hit.margin``; ties keep the sub-questions' ranks). A page seen earlier keeps its first place.
    Raw scores are not compared across sub-questions: a vague sub-question ("how many nodes are used?") gives
    many look-alike pages similar high scores, while the second page of a precise one stands well clear of its
    candidates (on bench/realdocs, rank by margin cites every needed page of 0.767 of multi-page questions at 4
    pages, rank by rank 0.733). A page that is one of the question's own images (``besides``) is shown as that
    image, not again."""
    ranked = [_distinct_pages(hs) for hs in hits]
    seen = set(besides)
    out = []
    rest = sorted(((rank, i, hit) for i, pages in enumerate(ranked) for rank, hit in enumerate(pages) if rank),
                  key=lambda t: (-t[2].margin, t[0], t[1]))
    for hit in [pages[0] for pages in ranked if pages] + [hit for _, _, hit in rest]:
        if hit.image_key not in seen:
            seen.add(hit.image_key)
            out.append(hit)
    return out


def choose_answer(requested: AnswerMode, hits: Sequence[Sequence[Hit]], *, misfit: Misfit,
                  popularity: PagePopularity, layout: Layout = Layout.CANONICAL,
                  images: Sequence[ImageKey] = (), max_pages: int = 0) -> AnswerChoice:
    """The mode for this question's pages. ``auto``: one prompt when the union fits (``misfit`` says), else per
    sub-question, as with the per_page layout, whose point is one page per prompt. One prompt shows at most
    ``max_pages`` pages (0: all), the best-ranked of :func:`union_pages` (each sub-question's best first); a
    forced one prompt that does not fit drops the lowest-ranked pages until it does. One prompt's pages go in
    the popularity order, so the pages most asked across questions lead it and its prefix recurs."""
    if requested is AnswerMode.PER_SUB_QUESTION:
        return AnswerChoice(AnswerMode.PER_SUB_QUESTION)
    if requested is AnswerMode.PER_IMAGE:
        return _per_image_choice(hits, misfit, images, max_pages)
    if requested is AnswerMode.AUTO and layout is Layout.PER_PAGE:
        return AnswerChoice(AnswerMode.PER_SUB_QUESTION, why="MMRAG_LAYOUT=per_page shows one page per prompt")
    pages = union_pages(hits, besides=images)
    kept = min(len(pages), max_pages) if max_pages else len(pages)
    why = misfit(pages[:kept])
    if why is not None and requested is AnswerMode.AUTO:
        return AnswerChoice(AnswerMode.PER_SUB_QUESTION, why=why)
    while kept and misfit(pages[:kept]) is not None:
        kept -= 1
    by_key = {p.image_key: p for p in pages[:kept]}
    ordered = tuple(by_key[k] for k in popularity.order(by_key))
    return AnswerChoice(AnswerMode.ONE_PROMPT, ordered, tuple(pages[kept:]))


def _per_image_choice(hits: Sequence[Sequence[Hit]], misfit: Misfit, images: Sequence[ImageKey], max_pages: int
                      ) -> AnswerChoice:
    """Per image: the pages one prompt would keep (:func:`union_pages`, at most ``max_pages``), each in its own
    prompt, in that ranking (each sub-question's best first: the order the joined answer reads in); a page whose
    own prompt does not fit is left out. One page or none is the one prompt itself."""
    pages = union_pages(hits, besides=images)
    kept = pages[:max_pages] if max_pages else pages
    shown = tuple(p for p in kept if misfit([p]) is None)
    left = tuple(p for p in pages if p not in shown)
    return AnswerChoice(AnswerMode.PER_IMAGE if len(shown) > 1 else AnswerMode.ONE_PROMPT, shown, left)


def per_image_plans(question: str, sub_questions: Sequence[str], pages: Sequence[Hit], *, max_tokens: int,
                    images: Sequence[ImageKey] = (), hits: Sequence[Sequence[Hit]] = ()) -> list[PlannedPrompt]:
    """A prompt per page of ``pages`` (the per-image answer, :class:`AnswerMode`): the question's own images,
    then that page alone, then :func:`one_prompt_text` over it with the sub-questions that retrieved it (all of
    them when none did). Each decodes ``ceil(max_tokens / len(pages))`` tokens, so the joined answer is one
    answer's length and decode, as the one prompt's.

    Why: one prompt over two pages reuses the second page's KV only behind the same first page; a page that
    leads its own prompt hits wherever it recurs, after any other page (the position oracle's reuse, exactly:
    each prompt is the same tokens a lone page's prompt is, warm-up's included). What it gives up: no prompt
    sees two images together, so a comparison across them is the reader's, from the joined parts."""
    share = -(-max_tokens // max(1, len(pages)))
    planned = []
    for page in pages:
        asked = [i for i, hs in enumerate(hits) if any(h.image_key == page.image_key for h in hs)]
        subs = [sub_questions[i] for i in asked] or list(sub_questions)
        keys = tuple(dict.fromkeys((*images, page.image_key)))
        plan = PromptPlan(keys, one_prompt_text(question, subs, [page], len(images), hits),
                          sampling=SamplingSpec(max_tokens=share))
        planned.append(PlannedPrompt(plan, asked[0] if asked else 0, page))
    return planned


def part_heading(page: Hit, first: bool) -> str:
    """What leads one image's part of a per-image answer: its label (with a figure's caption when the image is
    a figure's crop) and a colon, parts a blank line apart. The answer is each heading and its part's text."""
    return f"{'' if first else chr(10) * 2}{image_label(page, in_prompt=False)}: "


# Words by which a question asks for what a page SAYS, not what its figure shows: the page is shown then. Whole
# words only ("cross-section" is not "section").
_PAGE_WORDS = re.compile(r"(?<![\w-])(?:text|texts|paragraphs?|sections?|passages?|surrounding|according|why|"
                         r"explain\w*|discuss\w*|mention\w*|say|says|said|conclu\w*)(?![\w-])", re.IGNORECASE)


def needs_page(question: str, figure: PageFigure, *, whole: str = "") -> str | None:
    """Why ``question`` needs more than ``figure``'s crop (None when the crop is enough): it, or the ``whole``
    question it was split from, asks what the page says around the figure (its words: "according to the text",
    "why", "explain", "what does the section conclude"; _PAGE_WORDS), or it names another figure or table than
    this one ("is Figure 2 like Table 3?"), which the page may show beside it. A rule over the question's words,
    so it errs on the page's side: a question the crop would answer but that uses one of those words costs the
    page's tokens, never an answer."""
    for text in (question, whole):
        if word := _PAGE_WORDS.search(text):
            return f"it asks what the page says ({word.group(0)!r})"
    others = [ref for ref in figure_refs(question) if not figure.region.named_by(ref)]
    if others:
        kind, number = others[0]
        return f"it names {kind} {number} too"
    return None


def shown_as_figures(hits: Sequence[Sequence[Hit]], questions: Sequence[str], whole: str = "") -> list[list[Hit]]:
    """Each hit on a figure (``Hit.figure``) shown as the figure's crop, its image key and tokens, the page's
    place kept for the citation, unless its sub-question (``questions[i]`` found ``hits[i]``; ``whole``: the
    question they were split from) needs more than the figure (:func:`needs_page`): then it stays its page, the
    figure still named in its citation. What the model loses with the crop alone is the page around the figure:
    its body text, its other figures, and the caption's look (the caption is given as text: one_prompt_text,
    plan_prompts). A hit on no figure stays its page."""
    return [[dataclasses.replace(h, image_key=h.figure.image_key, image_tokens=h.figure.image_tokens)
             if h.figure is not None and needs_page(q, h.figure, whole=whole) is None else h for h in hs]
            for hs, q in zip(hits, questions, strict=True)]


def image_label(hit: Hit, *, in_prompt: bool = True) -> str:
    """What an image is: its page's label, and when it is a figure's crop, the figure's caption (in a prompt, said
    to be the figure alone)."""
    if hit.figure is not None and hit.shows_crop:
        alone = " (the figure alone)" if in_prompt else ""
        return f"{page_label(hit)}, {hit.figure.region.caption or hit.figure.label}{alone}"
    return page_label(hit)


def one_prompt_text(question: str, sub_questions: Sequence[str], pages: Sequence[Hit], n_images: int,
                    hits: Sequence[Sequence[Hit]] = ()) -> str:
    """The text after the images: what each image is (the question's own, then pages by label, the form the
    answer cites them in, a figure's crop with its caption; an image in several documents by each of its
    places, from ``hits``), the sub-questions when there are several, and the question last."""
    places: dict[ImageKey, dict[str, None]] = {p.image_key: {image_label(p): None} for p in pages}
    for hit in (h for hs in hits for h in hs):
        if hit.image_key in places:
            places[hit.image_key][image_label(hit)] = None
    lines = ["Images, in the order shown:"]
    lines += [f"Image {i}: sent with the question" for i in range(1, n_images + 1)]
    lines += [f"Image {i}: {', also '.join(places[p.image_key])}" for i, p in enumerate(pages, n_images + 1)]
    if len(sub_questions) > 1:
        lines.append("Answer each of these sub-questions from the images, citing pages by their labels:")
        lines += [f"{i}. {s}" for i, s in enumerate(sub_questions, 1)]
    lines.append(f"Question: {question}")
    return "\n".join(lines)


def one_prompt_plan(question: str, sub_questions: Sequence[str], pages: Sequence[Hit], *, max_tokens: int,
                    images: Sequence[ImageKey] = (), hits: Sequence[Sequence[Hit]] = ()) -> PromptPlan:
    """The one prompt: the question's images, then ``pages`` in the order given, then :func:`one_prompt_text`.
    The default system prompt and layout, as warm-up's single-page prompts: its first page hits their KV."""
    keys = tuple(dict.fromkeys((*images, *(p.image_key for p in pages))))
    return PromptPlan(keys, one_prompt_text(question, sub_questions, pages, len(images), hits),
                      sampling=SamplingSpec(max_tokens=max_tokens))


# --- per sub-question --------------------------------------------------------------------------------------


def plan_prompts(sub_questions: Sequence[str], hits: Sequence[Sequence[Hit]], *, max_tokens: int,
                 layout: Layout = Layout.CANONICAL, popularity: PagePopularity | None = None,
                 images: Sequence[ImageKey] = ()) -> list[PlannedPrompt]:
    """The per-sub-question plans of one question, in sub-question order; a sub-question without pages gets
    none, unless the question brought ``images``: those lead every plan (a page that is one of them is not shown
    twice).

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
        # A figure's crop is said to be one, with its caption (the model sees no page around it); a plan of
        # pages alone asks its sub-question, nothing more.
        crops: dict[ImageKey, str] = {}
        for h in hits[i]:  # best first: a crop in several documents is named by its best hit's place
            if h.shows_crop and h.image_key in keys:
                crops.setdefault(h.image_key, image_label(h))
        if not crops:
            return PlannedPrompt(PromptPlan(keys, sub_questions[i], sampling=sampling, layout=layout), i, page)
        text = "".join(f"{crops[k]}\n" for k in keys if k in crops) + sub_questions[i]  # in the images' order
        return PlannedPrompt(PromptPlan(keys, text, sampling=sampling, layout=layout), i, page, sub_questions[i])

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


def build_plans(sub_questions: Sequence[str], hits: Sequence[Sequence[Hit]], *, max_tokens: int,
                layout: Layout = Layout.CANONICAL, popularity: PagePopularity | None = None) -> list[PromptPlan]:
    """The plain plans of :func:`plan_prompts` (what the benchmark replays)."""
    return [p.plan for p in plan_prompts(sub_questions, hits, max_tokens=max_tokens, layout=layout,
                                         popularity=popularity)]


def synthesis_plan(question: str, planned: Sequence[PlannedPrompt], answers: Sequence[str], max_tokens: int
                   ) -> PromptPlan:
    """One text prompt over the sub-answers, numbered by sub-question; a per-page answer names its page
    (``Answer 1 from [doc.pdf, page 3]: ...``), the form the answers cite pages in."""
    lines = [f"Question: {question}"]
    for i, (_, group) in enumerate(groupby(zip(planned, answers), key=lambda row: row[0].sub_question), 1):
        rows = list(group)
        lines.append(f"Sub-question {i}: {rows[0][0].question}")
        lines += [f"Answer {i}{_source(p.page)}: {a.strip()}" for p, a in rows]
    return PromptPlan(images=(), text="\n".join(lines), system_prompt_id="synthesize",
                      sampling=SamplingSpec(max_tokens=max_tokens))


# --- pages -------------------------------------------------------------------------------------------------


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


def cite(hits: Sequence[Sequence[Hit]]) -> list[Citation]:
    """Every retrieved page once, with its best score, best first, and the figure its best hit that was on a
    figure named (Hit.figure)."""
    best: dict[tuple[str, int], Hit] = {}
    figure: dict[tuple[str, int], Hit] = {}
    for hit in (h for hs in hits for h in hs):
        k = (hit.doc, hit.page)
        if k not in best or hit.score > best[k].score:
            best[k] = hit
        if hit.figure is not None and (k not in figure or hit.score > figure[k].score):
            figure[k] = hit
    ranked = sorted(best.values(), key=lambda h: (-h.score, h.doc, h.page))
    return [Citation(h.page_id, h.doc, h.page, h.score, str(h.image_key),
                     figure[(h.doc, h.page)].figure if (h.doc, h.page) in figure else None) for h in ranked]


def page_label(page: Hit | Citation) -> str:
    """A page as answers cite it: ``[doc.pdf, page 3]``."""
    return f"[{page.doc}, page {page.page}]"


def _source(page: Hit | None) -> str:
    return f" from {page_label(page)}" if page is not None else ""
