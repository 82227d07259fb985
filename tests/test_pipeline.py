"""The RAG pipeline end to end on the session engine and index: sub-questions, pages, cited answers; and the
layouts that turn a question's pages into prompt plans."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from mmrag.core.figures import FigureRegion, PageFigure, needs_page
from mmrag.core.keys import ImageKey
from rag.decompose import BadQuestionError
from rag.llama import as_query_engine
from mmrag import wiring
from rag.order import PagePopularity
from rag.plans import (JOINT_PART_MIN_TOKENS, AnswerMode, build_plans, choice_plans, choose_answer, cite, fit_pages,
                       joint_parts, joint_plan,
                       joint_text, part_lengths, plan_prompts, relates_across, shown_as_figures, split_plans, stable_order,
                       synthesis_plan, union_pages)
from retrieval.search import Hit, NoDocumentsError, UnknownDocumentError
from mmrag.core.engine import Layout, PromptPlan

TWO_PART = "What is the retry limit and the timeout of the ingest service?"
APART = "What was the gross margin, and who signs off a production change?"


@pytest.fixture(scope="module")
async def pipeline(engine_settings, ingested, inprocess_engine):
    p, _ = wiring.pipeline(engine_settings.replace(**{"answer_max_tokens": 8}), inprocess_engine)
    yield p
    await p.searcher.client.close()


async def test_a_two_part_question_is_split_each_page_leading_a_prompt_with_the_parts_that_found_it(pipeline_with):
    p = pipeline_with()
    answer = await p.ask(TWO_PART)
    out = answer.to_json()
    assert out["sub_question_source"] == "rules"  # the random model's JSON is never grounded
    assert len(out["sub_questions"]) == 2 and out["answer_mode"] == "split" and "sub_answers" not in out
    assert out["answer_mode_reason"] == "its 2 parts found different pages: each page leads its own prompt"
    assert out["citations"] and all({"page_id", "doc", "page", "score", "figure"} == c.keys() for c in out["citations"])
    scores = [c["score"] for c in out["citations"]]
    assert scores == sorted(scores, reverse=True)
    # One prompt per cited page, that page alone, labelled as the answer cites it, with the question last.
    keys = {ImageKey.parse(k) for k in {c.image_key for c in answer.citations}}
    assert [len(plan.images) for plan in p.submitted] == [1] * len(keys) and \
        {plan.images[0] for plan in p.submitted} == keys
    assert all(plan.text.endswith(f"Question: {TWO_PART}") and plan.system_prompt_id == "default"
               for plan in p.submitted)
    # The parts' lengths add up to the answer's: the whole answer decodes no more than one answer's length.
    assert sum(plan.sampling.max_tokens for plan in p.submitted) == 8
    store = p.engine.features.store
    assert out["usage"]["image_tokens"] == sum(store.get(k).num_tokens for k in keys)
    assert out["model"]["random_weights"] is True
    assert 0 < out["usage"]["completion_tokens"] <= 8
    # Each part is headed by the page it was answered from, in the order the parts were planned.
    assert [a["page"] for a in out["image_answers"]] == [f"[{c.doc}, page {c.page}]" for c in
                                                         (next(c for c in answer.citations if c.image_key == str(
                                                             plan.images[0])) for plan in p.submitted)]
    # Where the time went, every stage that ran, in order.
    timings = out["timings"]
    assert list(timings) == ["decompose_s", "retrieve_s", "answer_s"]
    assert all(v >= 0 for v in timings.values()) and timings["answer_s"] > 0


async def test_a_comparison_sees_its_pages_together_in_a_stable_order_decoded_in_a_part_per_page(pipeline_with):
    p = pipeline_with(max_wait_ms=600_000)  # the parts wait for the first one's prefill however slow the CPU
    question = "Compare the retry limit of the ingest service and the gross margin"
    await p.engine.reset_prefix_cache()
    answer = await p.ask(question)
    out = answer.to_json()
    assert out["answer_mode"] == "joint" and "relates items across pages ('Compare')" in out["answer_mode_reason"]
    plans = list(p.submitted)  # a part per page: no sub-answers, no synthesis
    keys = {ImageKey.parse(c.image_key) for c in answer.citations}
    assert len(plans) == len(keys) > 1
    # Every part sees every page, in one order by key, behind the same text: one prefix, prefilled once.
    assert all(set(plan.images) == keys and list(plan.images) == sorted(plan.images, key=str) for plan in plans)
    joint = plans[0].text[:plans[0].text.index(f"Question: {question}") + len(f"Question: {question}")]
    assert all(plan.text.startswith(joint) for plan in plans)
    assert all(f"[{c['doc']}, page {c['page']}]" in joint for c in out["citations"])
    assert all(f"{i}. {q}" in joint for i, q in enumerate(answer.sub_questions, 1))
    # Part i asks for image i against the others; the parts' lengths add up to the answer's.
    assert [plan.text[len(joint):].split("Write part ")[1][:1] for plan in plans] == \
        [str(i) for i in range(1, len(plans) + 1)]
    assert sum(plan.sampling.max_tokens for plan in plans) == 8 and 0 < out["usage"]["completion_tokens"] <= 8
    # Prefilled once: the scheduler holds the other parts until the first one's prefill is done, then they hit
    # its pages (but for a partial last block each).
    assert out["usage"]["cached_image_tokens"] >= out["usage"]["image_tokens"] * (len(plans) - 1) / len(plans) \
        - 64 * len(plans)
    # Each part is headed by its page, in the prompt's order.
    labels = {c.image_key: f"[{c.doc}, page {c.page}]" for c in answer.citations}
    assert [a["page"] for a in out["image_answers"]] == [labels[str(k)] for k in plans[0].images]
    assert answer.answer.startswith(labels[str(plans[0].images[0])] + ": ")
    # The same question again renders the same prompts: their whole prefix recurs.
    await p.ask(question)
    assert p.submitted[len(plans):] == plans


async def test_a_joint_answer_too_short_for_its_parts_is_one_prompt(pipeline_with):
    p = pipeline_with(joint_part_min_tokens=JOINT_PART_MIN_TOKENS)  # the default: 8 tokens over 2+ pages
    answer = await p.ask("Compare the retry limit of the ingest service and the gross margin")
    out = answer.to_json()
    assert out["answer_mode"] == "joint" and len(p.submitted) == 1 and len(out["citations"]) > 1
    assert set(p.submitted[0].images) == {ImageKey.parse(c.image_key) for c in answer.citations}
    assert p.submitted[0].sampling.max_tokens == 8 and "Write part" not in p.submitted[0].text
    assert "image_answers" not in out or not out["image_answers"]


async def test_joint_overflows_into_sub_answers_and_a_synthesis_when_its_pages_do_not_fit(pipeline_with):
    p = pipeline_with(sub_answer_max_tokens=3, max_images_per_prompt=2, top_k=2)
    answer = await p.ask(APART, answer_mode="joint")
    out = answer.to_json()
    assert out["answer_mode"] == "joint" and len(out["sub_answers"]) == 2
    assert out["answer_mode_reason"].startswith("joint was asked for; one prompt does not fit (")
    assert "images, over MMRAG_MAX_IMAGES_PER_PROMPT=2): a prompt per sub-question" in out["answer_mode_reason"]
    *plans, synthesis = p.submitted
    assert [x.sampling.max_tokens for x in plans] == [3, 3] and synthesis.sampling.max_tokens == 8
    assert synthesis.system_prompt_id == "synthesize"
    assert list(out["timings"]) == ["decompose_s", "retrieve_s", "sub_answers_s", "synthesis_s"]
    assert out["timings"]["sub_answers_s"] > 0 and out["timings"]["synthesis_s"] > 0
    # A question may ask for a shorter answer, never a longer one; sub-answers stay within both.
    await p.ask(APART, answer_mode="joint", max_tokens=2)
    assert [x.sampling.max_tokens for x in p.submitted[3:]] == [2, 2, 2]
    # A context too small for every page with the answer overflows the same way.
    q = pipeline_with(max_model_len=900)
    assert "over MMRAG_MAX_MODEL_LEN=900" in (await q.ask(TWO_PART, answer_mode="joint")).extra["answer_mode_reason"]


async def test_the_old_answer_mode_names_still_work_and_say_they_are_deprecated(pipeline_with, caplog):
    p = pipeline_with()
    with caplog.at_level("WARNING"):
        split = await p.ask(TWO_PART, answer_mode="per_image")
        joint = await p.ask(TWO_PART, answer_mode="one_prompt")
    assert (split.extra["answer_mode"], joint.extra["answer_mode"]) == ("split", "joint")
    assert "'per_image' is deprecated" in caplog.text and "'one_prompt' is deprecated" in caplog.text
    with pytest.raises(ValueError):
        await p.ask(TWO_PART, answer_mode="per_paragraph")


def test_the_old_settings_say_they_are_deprecated_and_per_page_is_split(engine_settings, caplog):
    with caplog.at_level("WARNING"):
        old = engine_settings.model_validate({**engine_settings.model_dump(), "answer_mode": "per_sub_question"})
        per_page = engine_settings.model_validate({**engine_settings.model_dump(), "layout": "per_page"})
    assert old.answer.mode == "joint" and per_page.answer.mode == "split"
    assert "MMRAG_ANSWER_MODE=per_sub_question is deprecated" in caplog.text and "MMRAG_LAYOUT is deprecated" in \
        caplog.text
    assert wiring.pipeline_config(per_page).answer_mode is AnswerMode.SPLIT


@pytest.mark.parametrize("figure_crops", [False, True], ids=["pages", "figure_crops"])
@pytest.mark.parametrize("mode", ["joint", "split"])
async def test_a_cached_answer_is_the_cold_one_in_either_strategy(pipeline_with, figure_crops, mode):
    # fp32, greedy: the answer from the prefix cache is the answer computed cold, token for token; with
    # MMRAG_FIGURE_CROPS too, where a question about Figure 4 is shown its crop beside the other part's pages.
    p = pipeline_with(figure_crops=figure_crops)
    question = "What does Figure 4 show, and what is the retry limit?" if figure_crops else TWO_PART
    await p.engine.reset_prefix_cache()
    cold = await p.ask(question, answer_mode=mode)
    shown = {k for plan in p.submitted for k in plan.images}
    warm = await p.ask(question, answer_mode=mode)
    crops = [c.figure.image_key for c in cold.citations
             if c.figure is not None and c.image_key == str(c.figure.image_key)]
    assert len(crops) == figure_crops and all(k in shown for k in crops)
    # Cold, a split part hits nothing; a joint part after the first may hit the first one's pages. Warm, every
    # part hits its images but for a partial last block.
    parts = len(cold.extra.get("image_answers") or [None])
    assert cold.usage.cached_image_tokens == 0 if mode == "split" else \
        cold.usage.cached_image_tokens <= cold.usage.image_tokens * (parts - 1) / parts
    assert warm.usage.cached_image_tokens >= cold.usage.image_tokens - 64 * parts
    assert warm.answer == cold.answer and warm.usage.completion_tokens == cold.usage.completion_tokens


async def test_a_page_budget_shows_the_best_pages_and_leaves_the_others_out_uncited(pipeline_with):
    budget = pipeline_with(one_prompt_pages=2)
    for mode in ("joint", "split"):
        budget.submitted.clear()
        two = await budget.ask(TWO_PART, answer_mode=mode)
        shown = {k for plan in budget.submitted for k in plan.images}
        assert two.extra["answer_mode"] == mode and len(shown) == 2
        assert {ImageKey.parse(c.image_key) for c in two.citations} == shown and two.extra["pages_left_out"]


async def test_sub_questions_sharing_a_page_share_its_prefix_in_joints_overflow(pipeline_with):
    # Both sub-questions retrieve the design review's first page (and the architecture page): canonical order
    # puts the shared pages first in both plans, and the scheduler sends the second after the first's prefill.
    p = pipeline_with(max_model_len=900)  # not every page in one prompt, with the answer
    await p.engine.reset_prefix_cache()
    answer = await p.ask(TWO_PART, answer_mode="joint")
    assert "sub_answers" in answer.extra
    first, second = p.submitted[:2]
    shared = [k for k in first.images if k in second.images]
    assert len(shared) >= 2 and first.images[:2] == second.images[:2] == tuple(shared[:2])
    store = p.engine.features.store  # the second prompt's first two pages from the cache, in full blocks
    assert answer.usage.cached_image_tokens >= sum(store.get(k).num_tokens // 32 * 32 for k in shared[:2]) - 64


async def test_doc_filter_restricts_citations_and_unknown_docs_are_named(pipeline):
    answer = await pipeline.ask("What was the revenue?", docs=["q3_quarterly_report.pdf"])
    assert {c.doc for c in answer.citations} == {"q3_quarterly_report.pdf"}
    with pytest.raises(UnknownDocumentError, match="no_such.pdf"):
        await pipeline.ask("What was the revenue?", docs=["no_such.pdf"])


@pytest.mark.parametrize("question, message", [("   ", "empty"), ("x" * 10_000, "too long")])
async def test_bad_questions_get_a_clear_error(pipeline, question, message):
    with pytest.raises(BadQuestionError, match=message):
        await pipeline.ask(question)


async def test_no_documents_ingested_is_a_clear_error(tmp_path, engine_settings, inprocess_engine):
    empty, _ = wiring.pipeline(engine_settings.replace(**{"data_dir": tmp_path}), inprocess_engine)
    try:
        with pytest.raises(NoDocumentsError, match="mmrag ingest"):
            await empty.ask("What was the revenue?")
    finally:
        await empty.searcher.client.close()


async def test_the_pipeline_answers_as_a_llama_index_query_engine(pipeline):
    response = await as_query_engine(pipeline).aquery("What is the retry limit of the ingest service?")
    assert response.source_nodes and response.source_nodes[0].node.metadata["doc"]
    assert response.metadata["citations"][0]["doc"] == response.source_nodes[0].node.metadata["doc"]


def test_citations_keep_each_page_once_with_its_best_score():
    from mmrag.core.keys import ImageKey
    from retrieval.search import Hit

    key = ImageKey.parse(f"img1-{'a' * 64}-{'ab' * 8}-px1-2")
    hit = lambda doc, page, score: Hit(f"id-{doc}-{page}", "d", doc, page, score, "", key, 10, "/p")  # noqa: E731
    cites = cite([[hit("a.pdf", 1, 0.5), hit("b.pdf", 2, 0.9)], [hit("a.pdf", 1, 0.7)]])
    assert [(c.doc, c.page, c.score) for c in cites] == [("b.pdf", 2, 0.9), ("a.pdf", 1, 0.7)]
    assert [c.page_id for c in cites] == ["id-b.pdf-2", "id-a.pdf-1"]
    plans = build_plans(["q1", "q2"], [[hit("a.pdf", 1, 0.5)], []], max_tokens=4, layout=Layout.NAIVE)
    assert len(plans) == 1 and plans[0].layout is Layout.NAIVE  # a sub-question without pages gets no plan


def page_hit(doc: str, page: int, score: float = 0.5) -> Hit:
    """A retrieval hit whose image key is the page's own (the same page in two documents: pass the same doc)."""
    digest = hashlib.sha256(f"{doc}-{page}".encode()).hexdigest()
    key = ImageKey.parse(f"img1-{digest}-{'ab' * 8}-px1-2")
    return Hit(f"id-{doc}-{page}", "d", doc, page, score, "", key, 10, "/p")


def test_the_global_layout_orders_every_plan_by_the_learned_popularity():
    p, b, c = page_hit("a.pdf", 1), page_hit("a.pdf", 2), page_hit("b.pdf", 1)
    pop = PagePopularity()
    for _ in range(4):
        pop.observe([c.image_key])
    pop.observe([p.image_key, b.image_key])
    hits = [[b, p], [p, c, b]]
    plans = build_plans(["q1", "q2"], hits, max_tokens=4, layout=Layout.GLOBAL, popularity=pop)
    rank = pop.order([p.image_key, b.image_key, c.image_key])
    assert rank[0] == c.image_key  # asked 4 times; p and b once each, so by key
    assert [list(x.images) for x in plans] == [[k for k in rank if k != c.image_key], rank]
    assert all(x.layout is Layout.GLOBAL for x in plans)
    with pytest.raises(ValueError, match="popularity="):
        build_plans(["q1"], hits[:1], max_tokens=4, layout=Layout.GLOBAL)


def test_the_per_page_layout_gives_one_plan_per_sub_question_and_page_each_starting_with_it():
    a1, a2, b1 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("b.pdf", 1, 0.7)
    same_as_a1 = Hit("id-c", "d", "c.pdf", 4, 0.6, "", a1.image_key, 10, "/p")  # a1's image in another document
    planned = plan_prompts(["q1", "q2", "q3"], [[a1, a2, same_as_a1], [], [b1, a1]], max_tokens=4,
                           layout=Layout.PER_PAGE)
    assert [(p.plan.text, p.plan.images, p.page) for p in planned] == [
        ("q1", (a1.image_key,), a1), ("q1", (a2.image_key,), a2), ("q3", (b1.image_key,), b1),
        ("q3", (a1.image_key,), a1),
    ]
    assert [p.sub_question for p in planned] == [0, 0, 2, 2]
    assert all(p.plan.layout is Layout.PER_PAGE and p.plan.sampling.max_tokens == 4 for p in planned)


def test_the_synthesis_names_every_per_page_answer_with_its_page():
    a1, b3 = page_hit("a.pdf", 1), page_hit("b.pdf", 3)
    planned = plan_prompts(["q1", "q2"], [[a1, b3], [b3]], max_tokens=4, layout=Layout.PER_PAGE)
    plan = synthesis_plan("Q?", planned, [" x ", "y", "z"], max_tokens=6)
    assert plan.text == ("Question: Q?\nSub-question 1: q1\nAnswer 1 from [a.pdf, page 1]: x\n"
                         "Answer 1 from [b.pdf, page 3]: y\nSub-question 2: q2\nAnswer 2 from [b.pdf, page 3]: z")
    assert plan.images == () and plan.system_prompt_id == "synthesize" and plan.sampling.max_tokens == 6


def test_the_synthesis_of_one_plan_per_sub_question_is_as_before():
    planned = plan_prompts(["q1", "q2", "q3"], [[page_hit("a.pdf", 1)], [], [page_hit("a.pdf", 2)]],
                           max_tokens=4)
    assert synthesis_plan("Q?", planned, ["x", "y"], max_tokens=6).text == (
        "Question: Q?\nSub-question 1: q1\nAnswer 1: x\nSub-question 2: q3\nAnswer 2: y")


@pytest.mark.parametrize("layout", list(Layout))
def test_the_questions_images_lead_every_plan_in_every_layout(layout):
    image, a1, a2 = page_hit("question.png", 1).image_key, page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8)
    also_the_image = Hit("id-q", "d", "q.pdf", 1, 0.7, "", image, 10, "/p")  # the same picture, ingested
    popularity = PagePopularity() if layout is Layout.GLOBAL else None
    planned = plan_prompts(["q1", "q2"], [[a1, a2, also_the_image], []], max_tokens=4, layout=layout,
                           popularity=popularity, images=(image,))
    assert all(p.plan.images[0] == image and p.plan.images.count(image) == 1 for p in planned)
    # A sub-question without pages is still asked, about the question's images alone.
    assert (planned[-1].sub_question, planned[-1].plan.images) == (1, (image,))
    shown = [p.plan.images for p in planned[:-1]]
    if layout is Layout.PER_PAGE:
        assert shown == [(image, a1.image_key), (image, a2.image_key), (image,)]
    else:
        assert len(shown) == 1 and set(shown[0]) == {image, a1.image_key, a2.image_key}


def test_pages_make_room_for_the_questions_images_lowest_score_first():
    a1, a2, b1 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.5), page_hit("b.pdf", 1, 0.7)
    shown, cut = fit_pages([[a1, a2, b1], [a2]], room=2, layout=Layout.CANONICAL)
    assert shown == [[a1, b1], [a2]] and cut == [a2]  # per sub-question: a2 is the second one's best page
    assert fit_pages([[a1, a2, b1]], room=1, layout=Layout.PER_PAGE) == ([[a1, a2, b1]], [])  # one page a prompt
    assert fit_pages([[a1, a2, b1]], room=0, layout=Layout.PER_PAGE) == ([[]], [a1, a2, b1])
    with pytest.raises(ValueError, match="MMRAG_MAX_IMAGES_PER_PROMPT"):
        fit_pages([[a1]], room=-1, layout=Layout.CANONICAL)


async def test_every_layout_but_naive_renders_the_images_before_the_text(pipeline):
    key = page_hit("a.pdf", 1).image_key
    render = lambda layout: pipeline.engine.renderer.render(PromptPlan((key,), "Which page?", layout=layout))  # noqa: E731
    canonical = render(Layout.CANONICAL)
    assert canonical.index("<|image_pad|>") < canonical.index("Which page?")
    assert render(Layout.GLOBAL) == render(Layout.PER_PAGE) == canonical  # the same bytes: the same KV prefix


@pytest.fixture
async def pipeline_with(engine_settings, pipeline):
    """A pipeline wired with these settings on the session engine and index, recording every plan it submits
    (to the real scheduler)."""

    def build(joint_part_min_tokens: int = 1, **settings):
        settings = engine_settings.replace(**{"answer_max_tokens": 8, **settings})
        p, _ = wiring.pipeline(settings, pipeline.engine, client=pipeline.searcher.client)
        # A joint answer's parts at 8 tokens (their mechanics; by default a part is JOINT_PART_MIN_TOKENS at least).
        p.config = replace(p.config, joint_part_min_tokens=joint_part_min_tokens)
        p.submitted = []
        scheduled = p.submit

        async def submit(plan: PromptPlan, **kwargs):
            p.submitted.append(plan)
            return await scheduled(plan, **kwargs)

        p.submit = submit
        return p

    return build


# --- choosing the strategy, which pages, in which order -------------------------------------------------------


def test_the_union_keeps_each_sub_questions_best_pages_first_and_each_page_once():
    a1, a2, a3 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("a.pdf", 3, 0.7)
    b1, b2 = page_hit("b.pdf", 1, 0.95), page_hit("b.pdf", 2, 0.6)
    image = page_hit("question.png", 1).image_key
    assert union_pages([[a1, a2, a3], [b1, a1, b2]]) == [a1, b1, a2, a3, b2]
    assert union_pages([[a1, a2], [b1]], besides=(a1.image_key, image)) == [b1, a2]  # shown as the question's


def test_after_each_best_page_the_union_ranks_pages_by_how_far_they_stand_out_not_by_raw_score():
    """A vague sub-question's pages all score alike and high; a precise one's second page stands well clear of
    its candidates. The page budget goes to the page that stands out (Hit.margin), whatever its score."""
    precise = [replace(page_hit("a.pdf", 10, 3.4), margin=2.9), replace(page_hit("a.pdf", 11, 2.6), margin=2.1)]
    vague = [replace(page_hit("b.pdf", n, 2.2 - n / 100), margin=0.1) for n in range(1, 4)]
    assert union_pages([precise, vague])[:3] == [precise[0], vague[0], precise[1]]
    budget = choose_answer(AnswerMode.JOINT, [precise, vague], misfit=lambda pages: None, max_pages=3)
    assert {p.page for p in budget.pages if p.doc == "a.pdf"} == {10, 11} and len(budget.left_out) == 2


@pytest.mark.parametrize("question", [
    "Compare the revenue in Figure 3 and the headcount in Figure 7", "How does Figure 2 compare to Figure 5?",
    "What is the difference between the cache hit rate and the miss rate?", "What do both charts show?",
    "What is the relationship between latency and batch size?", "Is the trend across the figures the same?",
    "Which is higher, the revenue or the cost?", "Redis vs Qdrant: which is faster?",
    "How do the two plots differ?", "Are Figure 2 and Figure 3 similar?",
])
def test_a_question_that_relates_items_across_pages_is_told_apart(question):
    assert relates_across(question) is not None


@pytest.mark.parametrize("question", [
    "What is the retry limit and the timeout of the ingest service?", "What was the revenue between 2019 and 2020?",
    "What does Figure 4 show about the hit rate by workload?", "Which quarter peaks for revenue in Figure 3?",
    "How large is the change in headcount in Figure 2, and what does Figure 5 show?", "Explain the comparator circuit",
])
def test_a_question_of_independent_parts_is_not(question):
    assert relates_across(question) is None


def test_auto_is_joint_for_a_relating_question_and_split_otherwise():
    a1, a2, b1 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("b.pdf", 1, 0.95)
    hits, fits = [[a1, a2], [b1, a1]], lambda pages: None  # noqa: E731
    joint = choose_answer(AnswerMode.AUTO, hits, misfit=fits, question="Compare a and b")
    assert joint.mode is AnswerMode.JOINT and "'Compare'" in joint.why
    assert joint.pages == stable_order([a1, b1, a2]) and joint.left_out == ()
    said = choose_answer(AnswerMode.AUTO, hits, misfit=fits, question="a and b", relates="the decomposer says so")
    assert said.mode is AnswerMode.JOINT and said.why == "the decomposer says so"  # a model decomposer's flag
    split = choose_answer(AnswerMode.AUTO, hits, misfit=fits, question="What is a, and what is b?")
    assert split.mode is AnswerMode.SPLIT and split.pages == (a1, b1, a2) and "2 parts" in split.why
    # One part over several pages: split too, every page shown and cited.
    one = choose_answer(AnswerMode.AUTO, [[a1, a2, b1]], misfit=fits, question="What is a?")
    assert (one.mode, one.pages, one.left_out) == (AnswerMode.SPLIT, (a1, a2, b1), ())
    assert one.why == "one part over several pages: each page leads its own prompt"
    # One page in all is one prompt, whatever was asked.
    single = choose_answer(AnswerMode.SPLIT, [[a1]], misfit=fits)
    assert single.mode is AnswerMode.JOINT and single.pages == (a1,)


def test_a_joint_prompts_order_never_moves_and_its_overflow_says_why():
    a1, a2, b1 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("b.pdf", 1, 0.95)
    fits = lambda pages: None  # noqa: E731
    one = choose_answer(AnswerMode.JOINT, [[a1, a2], [b1]], misfit=fits)
    other = choose_answer(AnswerMode.JOINT, [[b1], [a2, a1]], misfit=fits)
    assert one.pages == other.pages == tuple(sorted((a1, a2, b1), key=lambda p: str(p.image_key)))
    two = lambda pages: None if len(pages) <= 2 else f"{len(pages)} images"  # noqa: E731
    over = choose_answer(AnswerMode.JOINT, [[a1, a2], [b1]], misfit=two)
    assert over.overflow and over.pages == () and "one prompt does not fit (3 images)" in over.why


def test_the_joint_prompt_labels_every_image_then_lists_the_sub_questions_and_asks_last():
    a1, b3 = page_hit("a.pdf", 1), page_hit("b.pdf", 3)
    image = page_hit("question.png", 1).image_key
    plan = joint_plan("Q?", ["q1", "q2"], [b3, a1], max_tokens=9, images=(image,))
    assert plan.images == (image, b3.image_key, a1.image_key) and plan.sampling.max_tokens == 9
    assert plan.text == ("Images, in the order shown:\nImage 1: sent with the question\nImage 2: [b.pdf, page 3]\n"
                         "Image 3: [a.pdf, page 1]\nAnswer each of these sub-questions from the images, citing "
                         "pages by their labels:\n1. q1\n2. q2\nQuestion: Q?")
    assert joint_text("Q?", ["Q?"], [a1], 0) == "Images, in the order shown:\nImage 1: [a.pdf, page 1]\nQuestion: Q?"


def test_joint_parts_are_the_joint_prompt_and_a_line_each_their_lengths_the_answers():
    a1, b3, c2 = page_hit("a.pdf", 1), page_hit("b.pdf", 3), page_hit("c.pdf", 2)
    image = page_hit("question.png", 1).image_key
    whole = joint_plan("Q?", ["q1", "q2"], [b3, a1, c2], max_tokens=10, images=(image,))
    parts = joint_parts("Q?", ["q1", "q2"], [b3, a1, c2], max_tokens=10, images=(image,), min_part_tokens=3)
    assert [p.page for p in parts] == [b3, a1, c2] and [p.plan.sampling.max_tokens for p in parts] == [4, 3, 3]
    assert all(p.plan.images == whole.images and p.plan.text.startswith(whole.text + "\n") for p in parts)
    assert parts[1].plan.text[len(whole.text):] == ("\nThe answer is written in 3 parts, one per page, at once. Write "
                                                    "part 2 only: what image 3 ([a.pdf, page 1]) shows for the "
                                                    "question, set against the other images.")
    # One page, or an answer too short for a part of min_part_tokens per page: the joint prompt itself.
    assert [p.plan for p in joint_parts("Q?", ["q"], [a1], max_tokens=10, min_part_tokens=1)] == [
        joint_plan("Q?", ["q"], [a1], max_tokens=10)]
    assert [p.plan for p in joint_parts("Q?", ["q"], [a1, b3, c2], max_tokens=8, min_part_tokens=3)] == [
        joint_plan("Q?", ["q"], [a1, b3, c2], max_tokens=8)]
    # By default a part is JOINT_PART_MIN_TOKENS at least: 4 tokens over 3 pages is one prompt, 128 three parts.
    assert len(joint_parts("Q?", ["q"], [a1, b3, c2], max_tokens=4)) == 1
    assert len(joint_parts("Q?", ["q"], [a1, b3, c2], max_tokens=3 * JOINT_PART_MIN_TOKENS - 1)) == 1
    assert len(joint_parts("Q?", ["q"], [a1, b3, c2], max_tokens=3 * JOINT_PART_MIN_TOKENS)) == 3
    choice = choose_answer(AnswerMode.JOINT, [[a1], [b3]], misfit=lambda pages: None)
    assert choice_plans(choice, "Q?", ["q1", "q2"], max_tokens=10, min_part_tokens=5) == joint_parts(
        "Q?", ["q1", "q2"], choice.pages, max_tokens=10, min_part_tokens=5)
    assert len(choice_plans(choice, "Q?", ["q1", "q2"], max_tokens=10)) == 1


def test_the_page_budget_keeps_each_sub_questions_best_pages_and_leaves_the_rest_out():
    a1, a2, a3 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("a.pdf", 3, 0.7)
    b1, b2 = page_hit("b.pdf", 1, 0.95), page_hit("b.pdf", 2, 0.6)
    hits, fits = [[a1, a2, a3], [b1, b2]], lambda pages: None  # noqa: E731
    for mode in (AnswerMode.AUTO, AnswerMode.JOINT, AnswerMode.SPLIT):
        choice = choose_answer(mode, hits, misfit=fits, max_pages=3)
        assert set(choice.pages) == {a1, b1, a2}
        assert choice.left_out == (b2, a3)  # not shown, so not cited (the pipeline lists them in pages_left_out)
    assert len(choose_answer(AnswerMode.AUTO, hits, misfit=fits).pages) == 5


def test_a_split_gives_each_kept_page_its_own_prompt_with_its_sub_questions_and_a_share_of_the_length():
    a1, a2, b1 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("b.pdf", 1, 0.95)
    hits, fits = [[a1, a2], [b1, a1]], lambda pages: None  # noqa: E731
    choice = choose_answer(AnswerMode.SPLIT, hits, misfit=fits, max_pages=2)
    assert choice.mode is AnswerMode.SPLIT and choice.pages == (a1, b1) and choice.left_out == (a2,)
    image = page_hit("question.png", 1).image_key
    planned = split_plans("Q?", ["q1", "q2"], choice.pages, max_tokens=9, images=(image,), hits=hits)
    assert [p.plan.images for p in planned] == [(image, a1.image_key), (image, b1.image_key)]
    assert [p.plan.sampling.max_tokens for p in planned] == [5, 4]  # 9 in all: one answer's length
    assert "1. q1\n2. q2" in planned[0].plan.text  # a1 was retrieved by both sub-questions
    assert planned[1].plan.text.endswith("Image 2: [b.pdf, page 1]\nQuestion: Q?") and "q1" not in planned[1].plan.text
    # A page whose own prompt does not fit is left out; one page left is one prompt, the joint one.
    no_b = lambda pages: "too big" if pages[0] == b1 else None  # noqa: E731
    one = choose_answer(AnswerMode.SPLIT, hits, misfit=no_b, max_pages=2)
    assert one.mode is AnswerMode.JOINT and one.pages == (a1,) and set(one.left_out) == {a2, b1}


@pytest.mark.parametrize("tokens, parts, shares", [(8, 3, [3, 3, 2]), (9, 2, [5, 4]), (128, 4, [32] * 4),
                                                   (2, 3, [1, 1, 1]), (5, 1, [5])])
def test_a_splits_parts_share_the_answers_length(tokens, parts, shares):
    assert part_lengths(tokens, parts) == shares


async def test_a_split_answer_streams_its_parts_in_order_as_one_answer_and_caches_as_cold(pipeline_with):
    """Each page leads its own prompt, so every one of them reuses its prefix when it recurs (not only the first
    of a prompt); fp32 greedy: the cached answer is the cold one, token for token."""
    p = pipeline_with()
    await p.engine.reset_prefix_cache()
    cold = await p.ask(TWO_PART, answer_mode="split")
    out = cold.to_json()
    assert out["answer_mode"] == "split" and len(out["image_answers"]) == len(p.submitted) > 1
    assert all(len(plan.images) == 1 for plan in p.submitted)
    assert {str(plan.images[0]) for plan in p.submitted} == {c.image_key for c in cold.citations} \
        == {a["image"] for a in out["image_answers"]}
    assert [plan.sampling.max_tokens for plan in p.submitted] == part_lengths(8, len(p.submitted))
    assert cold.answer == "".join(f"{'' if i == 0 else chr(10) * 2}{a['page']}: {a['answer']}"
                                  for i, a in enumerate(out["image_answers"]))
    assert cold.usage.cached_image_tokens == 0
    events = [e async for e in p.ask_events(TWO_PART, answer_mode="split")]
    done = events[-1]["answer"]
    tokens = [e["text"] for e in events if e["event"] == "token"]
    assert "".join(tokens) == done["answer"] == cold.answer
    assert tokens[0] == f"{out['image_answers'][0]['page']}: "  # the first part's heading at once
    assert len(tokens) > len(out["image_answers"]) + 1  # token by token, not part by part
    # Every image, wherever it sat, came from the prefix cache (all but its last partial block).
    assert done["usage"]["cached_image_tokens"] >= done["usage"]["image_tokens"] - 32 * len(p.submitted)


async def test_an_answer_leases_the_pages_it_shows_until_its_last_token(engine_settings, pipeline_with):
    """While an answer runs, a deletion (a document's, `mmrag store gc`) keeps its pages' tokens: the store's
    delete finds them leased. The lease ends with the answer."""
    store = wiring.feature_store(engine_settings)
    p = pipeline_with()
    seen: list[tuple[ImageKey, bool, int]] = []
    scheduled = p.submit

    async def submit(plan: PromptPlan, **kwargs):
        seen.extend((k, store.leased(k), store.delete(k)) for k in plan.images)  # a deletion mid-answer
        return await scheduled(plan, **kwargs)

    p.submit = submit
    answer = await p.ask(TWO_PART)
    assert seen and all(leased and freed == 0 for _, leased, freed in seen), seen
    assert all(store.contains(k) for k, _, _ in seen) and "pages_deleted" not in answer.extra
    assert not any(store.leased(k) for k, _, _ in seen), "the lease must end with the answer"


async def test_a_page_deleted_between_retrieval_and_the_answer_is_left_out_and_named(engine_settings,
                                                                                     pipeline_with):
    store = wiring.feature_store(engine_settings)
    p = pipeline_with()
    retrieve = p.searcher.search_many
    gone: dict[ImageKey, object] = {}

    async def search_then_delete(*args, **kwargs):
        found = await retrieve(*args, **kwargs)
        key = found[0][0].image_key
        gone[key] = store.get(key)
        assert store.delete(key) > 0  # no lease yet: retrieval is done, the answer's lease not yet taken
        return found

    p.searcher.search_many = search_then_delete
    try:
        answer = await p.ask(TWO_PART)
    finally:
        for key, value in gone.items():
            store.put(key, value)  # the session's store, as it was
    (key,) = gone
    out = answer.to_json()
    assert str(key) not in {c.image_key for c in answer.citations}
    assert all(key not in plan.images for plan in p.submitted)
    assert out["pages_deleted"] and out["answer"], out


def joint_prompt(plans: list[PromptPlan]) -> PromptPlan:
    """A joint answer's one prompt, or its parts' (each the same images and the same text up to its own line)."""
    assert plans and len({plan.images for plan in plans}) == 1, plans
    return plans[0]


async def test_a_question_naming_a_figure_cites_it_and_with_figure_crops_is_shown_the_crop_alone(pipeline_with):
    """Issue 26: the sample paper's page 4 holds "Figure 4: hit rate by workload". Its citation names the figure
    either way; MMRAG_FIGURE_CROPS shows the figure's crop (its own key, fewer tokens) instead of the page."""
    question = "What does Figure 4 show about the hit rate by workload?"
    pages = pipeline_with()
    answer = await pages.ask(question, answer_mode="joint")
    (cited,) = [c for c in answer.citations if c.figure is not None]
    assert (cited.doc, cited.page, cited.figure.region.number) == ("page_cache_paper.pdf", 4, 4)
    plan = joint_prompt(pages.submitted)
    assert ImageKey.parse(cited.image_key) in plan.images and cited.figure.image_key not in plan.images

    crops = pipeline_with(figure_crops=True)
    shown = await crops.ask(question, answer_mode="joint")
    (crop,) = [c for c in shown.citations if c.figure is not None]
    plan = joint_prompt(crops.submitted)
    n_joint = len(crops.submitted)
    assert crop.image_key == str(crop.figure.image_key) and crop.figure.image_key in plan.images
    assert "[page_cache_paper.pdf, page 4], Figure 4: hit rate by workload (the figure alone)" in plan.text
    # Split, the crop leads a prompt of its own and its part of the answer is headed by the figure.
    led = await crops.ask(question, answer_mode="split")
    alone = [plan for plan in crops.submitted[n_joint:] if plan.images == (crop.figure.image_key,)]
    assert len(alone) == 1 and len(crops.submitted) - n_joint == len(led.extra["image_answers"]) > 1
    assert "[page_cache_paper.pdf, page 4], Figure 4: hit rate by workload: " in led.answer
    assert ImageKey.parse(cited.image_key) not in plan.images  # the page itself is not shown
    # A question about what the page says around the figure is shown the page, the figure still cited.
    crops.submitted.clear()
    around = await crops.ask("According to the text, what does Figure 4 show about the hit rate by workload?",
                             answer_mode="joint")
    (named,) = [c for c in around.citations if c.figure is not None]
    plan = joint_prompt(crops.submitted)
    assert named.figure == cited.figure and named.image_key == cited.image_key
    assert ImageKey.parse(cited.image_key) in plan.images and cited.figure.image_key not in plan.images


def test_a_figure_hit_is_shown_as_its_crop_unless_its_question_needs_more_than_the_figure():
    """MMRAG_FIGURE_CROPS: a question about the figure is shown its crop; one that asks what the page says around
    it, or names another figure or table, is shown the page (its citation still names the figure)."""
    page_key, crop_key = (ImageKey.parse(f"img1-{c * 64}-{'ab' * 8}-px1-2") for c in "ab")
    figure = PageFigure(FigureRegion(4, "figure", "Figure 4: hit rate by workload", (72, 90, 400, 300), "vector"),
                        crop_key, 64)
    hit = Hit(page_id="p", doc_id="d", doc="paper.pdf", page=4, score=1.0, snippet="", image_key=page_key,
              image_tokens=247, path="paper.pdf", figure=figure)
    crop_alone = ["What does Figure 4 show?", "What does the chart of hit rate by workload show?",
                  "Which workload has the highest hit rate in figure 4?", "Compare Figure 4 and figure 4.",
                  "What do the page views by region look like in Figure 4?",  # "page" names no prose
                  "What does the cross-section in Figure 4b show?"]  # a panel of Figure 4; a word with a hyphen
    with_page = {"Why does the hit rate in Figure 4 drop?": "'Why'",
                 "According to the text, what does Figure 4 show?": "'According'",
                 "What does the section around Figure 4 conclude?": "'section'",
                 "How is Figure 4 explained?": "'explained'",
                 "Compare Figure 4 with Table 2.": "table 2", "Is Figure 4 like Fig. 5?": "figure 5"}
    for question in crop_alone:
        assert needs_page(question, figure) is None, question
    # The question a sub-question was split from frames it too; another figure it names does not.
    assert "'according'" in needs_page("What does Figure 4 show?", figure, whole="Summarise, according to the "
                                       "text, Figure 4 and Table 2.")
    assert needs_page("What does Figure 4 show?", figure, whole="Compare Figure 4 with Table 2.") is None
    roman = PageFigure(FigureRegion(None, "table", "TABLE IV: Costs by tier", (0, 0, 9, 9), "vector"), crop_key, 9)
    assert needs_page("What does Table IV list?", roman) is None
    assert "table V" in needs_page("Is Table IV like Table V?", roman)
    for question, why in with_page.items():
        assert why in needs_page(question, figure), question
    questions = [*crop_alone, *with_page]
    shown = shown_as_figures([[hit, replace(hit, figure=None)]] * len(questions), questions)
    for question, (first, whole) in zip(questions, shown):
        want = (crop_key, 64) if question in crop_alone else (page_key, 247)
        assert (first.image_key, first.image_tokens, first.figure) == (*want, figure), question
        assert whole == replace(hit, figure=None)  # a hit on no figure stays its page
    with pytest.raises(ValueError):  # a sub-question for every hit list
        shown_as_figures([[hit]], [])


def test_a_crop_is_said_to_be_one_in_every_prompt_that_shows_it_in_any_tier():
    """A figure's crop carries its caption and "(the figure alone)" in one prompt, per image and per sub-question
    (where the sub-answer still shows the sub-question as asked), in the asked tier too (its key's policy differs
    from the indexed crop's)."""
    from mmrag.core.keys import ResolutionPolicy
    from rag.plans import image_label

    page_key, crop_key = (ImageKey.parse(f"img1-{c * 64}-{'ab' * 8}-px1-2") for c in "ab")
    figure = PageFigure(FigureRegion(4, "figure", "Figure 4: hit rate by workload", (72, 90, 400, 300), "vector"),
                        crop_key, 64)
    page = Hit(page_id="p", doc_id="d", doc="paper.pdf", page=4, score=1.0, snippet="", image_key=page_key,
               image_tokens=247, path="paper.pdf")
    (crop,), = shown_as_figures([[replace(page, figure=figure)]], ["What does Figure 4 show?"])
    low = replace(crop, image_key=crop_key.in_policy(ResolutionPolicy(64 * 28 * 28, 256 * 28 * 28, pool=2)))
    said = "[paper.pdf, page 4], Figure 4: hit rate by workload (the figure alone)"
    for shown in (crop, low):
        assert shown.shows_crop and image_label(shown) == said
        assert said in joint_text("Q?", ["What does Figure 4 show?"], [shown], 0)
        (planned,) = plan_prompts(["What does Figure 4 show?"], [[shown]], max_tokens=8)
        assert planned.plan.text == f"{said}\nWhat does Figure 4 show?"
        assert planned.question == "What does Figure 4 show?"
    # Two crops are named in the order their images are shown (the canonical layout sorts them by key).
    other = PageFigure(FigureRegion(2, "table", "Table 2: costs", (1, 2, 3, 4), "vector"),
                       ImageKey.parse(f"img1-{'0' * 64}-{'ab' * 8}-px1-2"), 32)
    (two,) = plan_prompts(["Q?"], [[crop, replace(page, page=5, figure=other, image_key=other.image_key)]],
                          max_tokens=8)
    assert two.plan.images == (other.image_key, crop_key)
    assert two.plan.text == "[paper.pdf, page 5], Table 2: costs (the figure alone)\n" + said + "\nQ?"
    (plain,) = plan_prompts(["Which page?"], [[page]], max_tokens=8)  # pages alone: the sub-question, as before
    assert plain.plan.text == plain.question == "Which page?" and not page.shows_crop
    assert image_label(replace(page, figure=figure)) == "[paper.pdf, page 4]"  # the page, its figure named


async def test_a_question_in_a_tier_is_shown_the_crop_in_that_tier_and_told_it_is_the_figure(engine_settings,
                                                                                              pipeline_with):
    store = wiring.feature_store(engine_settings)
    before = set(store.keys())
    crops = pipeline_with(figure_crops=True, top_k=1)
    question = "What does Figure 4 show about the hit rate by workload?"
    try:
        answer = await crops.ask(question, tier="low")
    finally:
        for key in set(store.keys()) - before:  # the session's store, as it was (other tests count its entries)
            store.delete(key)
    (cited,) = [c for c in answer.citations if c.figure is not None]
    (plan,) = crops.submitted
    low = engine_settings.vision.tier_table.policy("low")
    (shown,) = [k for k in plan.images if k.content_hash == cited.figure.image_key.content_hash]
    assert shown.policy == low and answer.extra["tier"] == {"name": "low", "fell_back": []}
    assert "[page_cache_paper.pdf, page 4], Figure 4: hit rate by workload (the figure alone)" in plan.text


async def test_with_figure_crops_warm_up_leaves_the_crop_a_question_is_shown_resident(pipeline_with):
    """With MMRAG_FIGURE_CROPS a prompt leads with a figure's crop, so warm-up (serving/warmup.leading_images, as
    `mmrag serve` and `mmrag warm` rank it) warms crops beside pages: after it, the crop a question about Figure 4
    is shown comes from the prefix cache, all but its last partial block; without crops only the page is warmed."""
    from mmrag.adapters.qdrant import AsyncPageReader
    from serving.warmup import leading_images, rank_by_demand, warm

    # One page a sub-question: the canonical layout orders a prompt's images by key, so with other pages the crop
    # would lead only where its content hash sorts first.
    crops = pipeline_with(figure_crops=True, top_k=1)
    question = "What does Figure 4 show about the hit rate by workload?"
    (cited,) = [c for c in (await crops.ask(question)).citations if c.figure is not None]
    page = await AsyncPageReader(crops.searcher.client, crops.searcher.collection).get(cited.page_id)
    assert [c.key for c in rank_by_demand(leading_images([page], figure_crops=False))] == [page.image_key]
    candidates = rank_by_demand(leading_images([page], figure_crops=True))
    assert cited.figure.image_key in {c.key for c in candidates} and page.image_key in {c.key for c in candidates}
    await crops.engine.reset_prefix_cache()
    report = await warm(crops.engine, candidates)
    assert set(report.warmed) == {c.key for c in candidates}
    crops.submitted.clear()
    shown = await crops.ask(question)
    (plan,) = crops.submitted
    assert plan.images[0] == cited.figure.image_key
    usage = shown.usage
    assert usage.cached_image_tokens >= cited.figure.image_tokens - 32 > 0, usage


def test_a_split_has_no_more_parts_than_the_answer_has_tokens():
    pages = [page_hit("a.pdf", n, 1 - n / 10) for n in range(1, 5)]
    fits = lambda pages: None  # noqa: E731
    assert len(choose_answer(AnswerMode.SPLIT, [pages], misfit=fits, max_parts=2).pages) == 2
    assert len(choose_answer(AnswerMode.SPLIT, [pages], misfit=fits, max_pages=3, max_parts=8).pages) == 3
    assert choose_answer(AnswerMode.SPLIT, [pages], misfit=fits, max_parts=1).mode is AnswerMode.JOINT
