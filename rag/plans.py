"""How a question's retrieved pages become prompt plans: pure functions over hits, testable without an engine.

Two answer strategies (:class:`AnswerMode`, MMRAG_ANSWER_MODE; per question ``answer_mode``), both exact (the
model sees whole pages or figures, nothing is approximated) and both citing every page they show:

- **split** (:func:`split_plans`): every shown image leads a prompt of its own, with the sub-questions that
  retrieved it; the parts, each under a heading that names its page (and figure), are one answer whose length
  is the answer's. Every recurrence of a page hits the KV of its prefix, wherever it recurs and whatever else
  the question asked: the image-token reuse mmrag exists for. What it gives up: no prompt sees two images.
- **joint** (:func:`joint_parts`): the union of the sub-questions' pages seen together, in one stable order
  (:func:`stable_order`), for questions that need pages seen together. Its answer is decoded in parts, one per
  shown page, side by side: every part's prompt is the same prompt over all the pages (its KV prefilled once,
  the other parts hit it) with one line more, which asks for what that page shows set against the others; the
  parts' lengths add up to the answer's. An answer too short for parts of JOINT_PART_MIN_TOKENS each is one
  prompt (the parts' extra prefill would outweigh the decode steps they save). A CPU or GPU decodes a batch of parts in about the steps of one part,
  where one prompt would decode the answer's length one token at a time (a comparison at 128 tokens took twice
  the time at the floor). What it gives up: a part does not read the others' text, so two parts may say the same
  thing. When the pages and the answer do not fit one prompt, it overflows into a prompt per sub-question and a
  text synthesis over their answers (:func:`plan_prompts`, :func:`synthesis_plan`): an internal path, never a
  strategy a user picks.

``auto`` (the default) chooses per question, and the answer's ``answer_mode_reason`` says which rule chose
(:func:`choose_answer`):

1. joint when the question relates items across pages (:func:`relates_across`: the decomposer's comparison
   forms, "difference between", "relationship", "trend across", "both", "versus", ...; a model decomposer can
   say the same of its sub-questions);
2. split when its parts found different pages: each page leads its own prompt with the parts that found it;
3. a one-part question over several pages: split too, each page answering the question for itself (a real model
   says of a page that cannot answer it that it does not; every page is cited, and each part's prefix is warm).
   Showing only the page that stands out (its margin over the candidates twice the next page's or more) was
   measured and dropped: on mmrag/bench/realdocs it left out a needed page of a multi-page question at every
   threshold tried (every page cited for 0.733 of them instead of 0.767);
4. one page in all: a one-page prompt (split and joint are the same prompt then).

Images sent with the question (already encoded and stored by the caller) lead every prompt of that question,
before its pages; pages make room for them, lowest score first.

Old strategy names keep working one release, with a deprecation line in the log: ``one_prompt`` is joint,
``per_image`` is split, ``per_sub_question`` is joint (its per-sub-question path is joint's overflow now).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

from mmrag.core.engine import Layout, PromptPlan, SamplingSpec
from mmrag.core.figures import shown_as_crop
from mmrag.core.keys import ImageKey
from mmrag.core.settings import DEPRECATED_ANSWER_MODES
from rag.answer import Citation
from rag.order import PagePopularity, canonical_order
from retrieval.search import Hit

logger = logging.getLogger(__name__)



class AnswerMode(str, enum.Enum):
    """How the retrieved pages become the answer (MMRAG_ANSWER_MODE; per question: ``answer_mode``)."""

    AUTO = "auto"  # per question: joint when it relates pages, else split (module docstring)
    SPLIT = "split"  # every shown image leads a prompt of its own; the parts are one answer
    JOINT = "joint"  # one prompt over the pages (overflowing into per sub-question + synthesis)

    @classmethod
    def _missing_(cls, value: object) -> AnswerMode | None:
        """An old name (mmrag/core/settings.DEPRECATED_ANSWER_MODES) is its successor, said once in the log each time it
        is read."""
        if isinstance(value, str) and value in DEPRECATED_ANSWER_MODES:
            new = DEPRECATED_ANSWER_MODES[value]
            logger.warning("answer mode %r is deprecated and will be removed in the next release: it is %r now; "
                           "ask for %r (or leave it unset: auto chooses per question)", value, new, new)
            return cls(new)
        return None


@dataclass(slots=True, frozen=True)
class PlannedPrompt:
    """One plan and what the synthesis needs to label its answer."""

    plan: PromptPlan
    sub_question: int  # index into the sub-questions
    page: Hit | None = None  # a split part's page, or a per-page plan's
    asked: str | None = None  # the sub-question, where the plan's text also says what its images are

    @property
    def question(self) -> str:
        """What this plan asks, as the sub-answers and the synthesis show it."""
        return self.plan.text if self.asked is None else self.asked


# --- choosing -----------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class AnswerChoice:
    """The strategy that answers a question, what it shows, and why."""

    mode: AnswerMode  # SPLIT or JOINT, never AUTO
    pages: tuple[Hit, ...] = ()  # split: one prompt each, in the answer's order; joint: the prompt's, in order
    left_out: tuple[Hit, ...] = ()  # retrieved pages it does not show (no room, or another page stood out)
    why: str = ""  # which rule chose (the answer's answer_mode_reason)
    overflow: bool = False  # joint that does not fit one prompt: per sub-question, then a synthesis


# A candidate set of pages -> None when one prompt over them fits, else why not (for the answer to say).
Misfit = Callable[[Sequence[Hit]], str | None]

# Words by which a question relates items across pages: joint. Whole words; "both" and "versus" included, since
# "what do both charts show" asks for the two together. The rule decomposer's comparison forms are among them.
_RELATES = re.compile(
    r"(?<![\w-])(?:compar(?:e|es|ed|ing|ison|isons)|contrast(?:s|ed|ing)?|versus|vs\.?|"
    r"differ(?:s|ed|ence|ences)?|relationship|relation|correlat\w*|similar(?:ly|ity|ities)?|in common|both|"
    r"trends? across|across (?:the |these |those |all )?(?:figures|pages|charts|tables|plots|slides|documents)|"
    r"which (?:of (?:the|these) )?(?:is|was|are|has|had) (?:higher|lower|larger|smaller|bigger|greater|more|"
    r"less|faster|slower|better|worse))(?![\w-])",
    re.IGNORECASE)


def relates_across(question: str) -> str | None:
    """Why ``question`` needs its pages seen together (the words that say so), or None. A rule over words that
    errs towards joint: a compound question that says "both" costs one prompt's hit rate, never an answer."""
    if m := _RELATES.search(question):
        return f"it relates items across pages ({' '.join(m.group(0).split()[:4])!r})"
    return None


def union_pages(hits: Sequence[Sequence[Hit]], *, besides: Sequence[ImageKey] = ()) -> list[Hit]:
    """Every distinct page the sub-questions retrieved, once, ranked for keeping: each sub-question's best page
    first (in the sub-questions' order), then the others by how far each stands out from its own sub-question's
    candidates (``Hit.margin``; ties keep the sub-questions' ranks). A page seen earlier keeps its first place.
    Raw scores are not compared across sub-questions: a vague sub-question ("how many nodes are used?") gives
    many look-alike pages similar high scores, while the second page of a precise one stands well clear of its
    candidates (on mmrag/bench/realdocs, rank by margin cites every needed page of 0.767 of multi-page questions at 4
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


def stable_order(pages: Sequence[Hit]) -> tuple[Hit, ...]:
    """A joint prompt's pages in one order that never moves: by image key. The same page set renders the same
    tokens in every question and every process, so a recurring set hits its whole prefix, not only its first
    page. (An order learned from popularity moves while it learns, and each move renders a recurring set anew;
    every page's lone prefix is warm either way, since warm-up prefills pages one by one.)"""
    return tuple(sorted(pages, key=lambda p: str(p.image_key)))


def choose_answer(requested: AnswerMode, hits: Sequence[Sequence[Hit]], *, misfit: Misfit, question: str = "",
                  relates: str | None = None, images: Sequence[ImageKey] = (), max_pages: int = 0,
                  max_parts: int = 0) -> AnswerChoice:
    """The strategy for this question's pages (``hits``: each sub-question's, best first), by the rules of the
    module docstring for ``auto``. ``relates``: why the decomposer says the parts need their pages together
    (None: it does not); the question's own words are read too (:func:`relates_across`). At most ``max_pages``
    pages are shown (0: all), the best of :func:`union_pages`; a split leaves out a page whose own prompt does
    not fit, a joint one that does not fit one prompt overflows (:class:`AnswerChoice`)."""
    split_pages = min(max_pages or max_parts, max_parts) if max_parts else max_pages
    if requested is AnswerMode.SPLIT:
        return _split(hits, misfit, images, split_pages, "split was asked for")
    if requested is AnswerMode.JOINT:
        return _joint(hits, misfit, images, max_pages, "joint was asked for")
    if why := relates or relates_across(question):
        return _joint(hits, misfit, images, max_pages, why)
    asked = [hs for hs in hits if hs]
    why = (f"its {len(asked)} parts found different pages: each page leads its own prompt" if len(asked) > 1 else
           "one part over several pages: each page leads its own prompt")
    return _split(hits, misfit, images, split_pages, why)


def _split(hits: Sequence[Sequence[Hit]], misfit: Misfit, images: Sequence[ImageKey], max_pages: int, why: str
           ) -> AnswerChoice:
    """Split: the pages a joint prompt would keep (:func:`union_pages`, at most ``max_pages``), each in its own
    prompt, in that ranking (each sub-question's best first: the order the answer reads in); a page whose own
    prompt does not fit is left out. One page or none is one prompt, which is the joint one."""
    pages = union_pages(hits, besides=images)
    kept = pages[:max_pages] if max_pages else pages
    shown = tuple(p for p in kept if misfit([p]) is None)
    left = tuple(p for p in pages if p not in shown)
    if len(shown) > 1:
        return AnswerChoice(AnswerMode.SPLIT, shown, left, why)
    return AnswerChoice(AnswerMode.JOINT, shown, left, f"{why}; one page to show: one prompt")


def _joint(hits: Sequence[Sequence[Hit]], misfit: Misfit, images: Sequence[ImageKey], max_pages: int, why: str
           ) -> AnswerChoice:
    """Joint: the best ``max_pages`` of :func:`union_pages` in :func:`stable_order`; when they do not fit one
    prompt, the overflow (a prompt per sub-question, then a synthesis), the reason saying why.

    Each part's best page alone would halve a comparison's prompt (and its uncached half), but was measured and
    not taken: on mmrag/bench/realdocs every needed page was then cited for 0.700 of the multi-page questions, against
    0.767 with the budget."""
    pages = union_pages(hits, besides=images)
    kept = pages[:max_pages] if max_pages else pages
    if (misfit_why := misfit(kept)) is not None:
        return AnswerChoice(AnswerMode.JOINT, (), (), f"{why}; one prompt does not fit ({misfit_why}): a prompt "
                            "per sub-question, then a synthesis", overflow=True)
    return AnswerChoice(AnswerMode.JOINT, stable_order(kept), tuple(pages[len(kept):]), why)


def split_plans(question: str, sub_questions: Sequence[str], pages: Sequence[Hit], *, max_tokens: int,
                images: Sequence[ImageKey] = (), hits: Sequence[Sequence[Hit]] = ()) -> list[PlannedPrompt]:
    """A prompt per page of ``pages`` (the split answer): the question's own images, then that page alone, then
    :func:`joint_text` over it with the sub-questions that retrieved it (all of them when none did). The parts'
    lengths add up to ``max_tokens`` (:func:`part_lengths`), so the answer decodes one answer's length.

    Why: one prompt over two pages reuses the second page's KV only behind the same first page; a page that
    leads its own prompt hits wherever it recurs, after any other page (the position oracle's reuse, exactly:
    each prompt is the same tokens a lone page's prompt is, warm-up's included). What it gives up: no prompt
    sees two images together, so a comparison across them is the reader's, from the joined parts."""
    planned = []
    for page, share in zip(pages, part_lengths(max_tokens, len(pages)), strict=True):
        asked = [i for i, hs in enumerate(hits) if any(h.image_key == page.image_key for h in hs)]
        subs = [sub_questions[i] for i in asked] or list(sub_questions)
        keys = tuple(dict.fromkeys((*images, page.image_key)))
        plan = PromptPlan(keys, joint_text(question, subs, [page], len(images), hits),
                          sampling=SamplingSpec(max_tokens=share))
        planned.append(PlannedPrompt(plan, asked[0] if asked else 0, page))
    return planned


# The shortest part a joint answer is decoded in (joint_parts). A part costs the whole joint prompt once more
# (its images hit the first part's KV; its text and line are prefilled again) and waits for the first part's
# prefill; it saves the decode steps the parts take side by side. Measured end to end (docs/benchmarks.md, issue 40):
# at 128 tokens over 4 pages (32-token parts) the parts win 1.58x on comparisons; at 4 tokens (1-token parts)
# one prompt wins, the parts' extra prefill and wait costing more than 3 decode steps saved. Below 16 tokens a
# part, the answer is one prompt.
JOINT_PART_MIN_TOKENS = 16


def joint_parts(question: str, sub_questions: Sequence[str], pages: Sequence[Hit], *, max_tokens: int,
                images: Sequence[ImageKey] = (), hits: Sequence[Sequence[Hit]] = (),
                min_part_tokens: int = JOINT_PART_MIN_TOKENS) -> list[PlannedPrompt]:
    """The joint answer in parts (module docstring): one per page of ``pages``, each the joint prompt
    (:func:`joint_plan`, the same images in the same order and the same text, so every part after the first
    hits the first one's KV) and then a line asking for that page's part, set against the other images. The
    parts' lengths add up to ``max_tokens`` (:func:`part_lengths`). One page, or an answer too short for a part
    of ``min_part_tokens`` per page (JOINT_PART_MIN_TOKENS: decode then weighs less than the parts' extra
    prefill): the joint prompt alone."""
    whole = joint_plan(question, sub_questions, pages, max_tokens=max_tokens, images=images, hits=hits)
    if len(pages) < 2 or max_tokens < len(pages) * max(1, min_part_tokens):
        return [PlannedPrompt(whole, 0, pages[0] if pages else None)]
    n = len(pages)
    planned = []
    for i, (page, share) in enumerate(zip(pages, part_lengths(max_tokens, n), strict=True)):
        line = (f"\nThe answer is written in {n} parts, one per page, at once. Write part {i + 1} only: what "
                f"image {len(images) + i + 1} ({image_label(page)}) shows for the question, set against the other "
                "images.")
        plan = dataclasses.replace(whole, text=whole.text + line, sampling=SamplingSpec(max_tokens=share))
        planned.append(PlannedPrompt(plan, 0, page))
    return planned


def choice_plans(choice: AnswerChoice, question: str, sub_questions: Sequence[str], *, max_tokens: int,
                 images: Sequence[ImageKey] = (), hits: Sequence[Sequence[Hit]] = (),
                 min_part_tokens: int = JOINT_PART_MIN_TOKENS) -> list[PlannedPrompt]:
    """The plans that answer ``choice`` (not its overflow, planned once the sub-answers exist): the split's
    parts (:func:`split_plans`) or the joint's (:func:`joint_parts`, parts of ``min_part_tokens`` at least), in
    the answer's order."""
    if choice.overflow:
        raise ValueError("joint's overflow is planned per sub-question (plan_prompts), then a synthesis")
    if choice.mode is AnswerMode.SPLIT:
        return split_plans(question, sub_questions, choice.pages, max_tokens=max_tokens, images=images, hits=hits)
    return joint_parts(question, sub_questions, choice.pages, max_tokens=max_tokens, images=images, hits=hits,
                       min_part_tokens=min_part_tokens)


def part_lengths(max_tokens: int, parts: int) -> list[int]:
    """Each part's share of an answer of ``max_tokens``: equal shares adding up to it exactly (the first parts
    one token longer where it does not divide), at least one token each (more parts than tokens: one each)."""
    if parts < 1:
        return []
    base, extra = divmod(max_tokens, parts)
    return [max(1, base + (i < extra)) for i in range(parts)]


def part_heading(page: Hit, first: bool) -> str:
    """What leads one image's part of a split answer: its label (with a figure's caption when the image is a
    figure's crop) and a colon, parts a blank line apart. The answer is each heading and its part's text."""
    return f"{'' if first else chr(10) * 2}{image_label(page, in_prompt=False)}: "


def shown_as_figures(hits: Sequence[Sequence[Hit]], questions: Sequence[str], whole: str = "") -> list[list[Hit]]:
    """Each hit on a figure (``Hit.figure``) shown as the figure's crop, its image key and tokens, the page's
    place kept for the citation, unless its sub-question (``questions[i]`` found ``hits[i]``; ``whole``: the
    question they were split from) needs more than the figure (mmrag/core/figures.py shown_as_crop, needs_page):
    then it stays its page, the figure still named in its citation. What the model loses with the crop alone is
    the page around the figure: its body text, its other figures, and the caption's look (the caption is given as
    text: joint_text, plan_prompts). A hit on no figure stays its page."""
    return [[dataclasses.replace(h, image_key=h.figure.image_key, image_tokens=h.figure.image_tokens)
             if shown_as_crop(q, h.figure, whole=whole) else h for h in hs]
            for hs, q in zip(hits, questions, strict=True)]


def image_label(hit: Hit, *, in_prompt: bool = True) -> str:
    """What an image is: its page's label, and when it is a figure's crop, the figure's caption (in a prompt, said
    to be the figure alone)."""
    if hit.figure is not None and hit.shows_crop:
        alone = " (the figure alone)" if in_prompt else ""
        return f"{page_label(hit)}, {hit.figure.region.caption or hit.figure.label}{alone}"
    return page_label(hit)


def joint_text(question: str, sub_questions: Sequence[str], pages: Sequence[Hit], n_images: int,
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


def joint_plan(question: str, sub_questions: Sequence[str], pages: Sequence[Hit], *, max_tokens: int,
                    images: Sequence[ImageKey] = (), hits: Sequence[Sequence[Hit]] = ()) -> PromptPlan:
    """The joint prompt: the question's images, then ``pages`` in the order given, then :func:`joint_text`.
    The default system prompt and layout, as warm-up's single-page prompts: its first page hits their KV, and a
    one-page joint prompt is the same tokens as that page's split part."""
    keys = tuple(dict.fromkeys((*images, *(p.image_key for p in pages))))
    return PromptPlan(keys, joint_text(question, sub_questions, pages, len(images), hits),
                      sampling=SamplingSpec(max_tokens=max_tokens))


# --- joint's overflow: per sub-question, then a synthesis ----------------------------------------------------


def plan_prompts(sub_questions: Sequence[str], hits: Sequence[Sequence[Hit]], *, max_tokens: int,
                 layout: Layout = Layout.CANONICAL, popularity: PagePopularity | None = None,
                 images: Sequence[ImageKey] = ()) -> list[PlannedPrompt]:
    """The per-sub-question plans of one question, in sub-question order (joint's overflow uses the canonical
    layout; the engine-level benchmark replays the others): a sub-question without pages gets none, unless the
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
