"""The RAG pipeline end to end on the session engine and index: sub-questions, pages, cited answers; and the
layouts that turn a question's pages into prompt plans."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from core.figures import FigureRegion, PageFigure
from core.keys import ImageKey
from rag.decompose import BadQuestionError
from rag.llama import as_query_engine
from mmrag import wiring
from rag.order import PagePopularity
from rag.plans import (AnswerMode, build_plans, choose_answer, cite, fit_pages, needs_page, one_prompt_plan,
                       one_prompt_text, per_image_plans, plan_prompts, shown_as_figures, synthesis_plan, union_pages)
from retrieval.search import Hit, NoDocumentsError, UnknownDocumentError
from core.engine import Layout, PromptPlan

TWO_PART = "What is the retry limit and the timeout of the ingest service?"
APART = "What was the gross margin, and who signs off a production change?"


@pytest.fixture(scope="module")
async def pipeline(engine_settings, ingested, inprocess_engine):
    p, _ = wiring.pipeline(engine_settings.model_copy(update={"answer_max_tokens": 8}), inprocess_engine)
    yield p
    await p.searcher.client.close()


async def test_a_two_part_question_is_answered_in_one_prompt_over_its_sub_questions_pages(pipeline_with):
    p = pipeline_with("canonical")
    answer = await p.ask(TWO_PART)
    out = answer.to_json()
    assert out["sub_question_source"] == "rules"  # the random model's JSON is never grounded
    assert len(out["sub_questions"]) == 2 and out["answer_mode"] == "one_prompt" and "sub_answers" not in out
    assert out["citations"] and all({"page_id", "doc", "page", "score", "figure"} == c.keys() for c in out["citations"])
    scores = [c["score"] for c in out["citations"]]
    assert scores == sorted(scores, reverse=True)
    (plan,) = p.submitted  # one request: no sub-answers, no synthesis
    # Every cited page is shown once, labelled as the answer cites it; both sub-questions are listed.
    keys = {ImageKey.parse(k) for k in {c.image_key for c in answer.citations}}
    assert set(plan.images) == keys and len(plan.images) == len(keys)
    assert all(f"[{c['doc']}, page {c['page']}]" in plan.text for c in out["citations"])
    assert all(f"{i}. {q}" in plan.text for i, q in enumerate(answer.sub_questions, 1))
    assert plan.text.endswith(f"Question: {TWO_PART}") and plan.system_prompt_id == "default"
    assert out["usage"]["image_tokens"] == 247 * len(keys) and out["model"]["random_weights"] is True
    assert 0 < out["usage"]["completion_tokens"] <= 8
    # Where the time went, every stage that ran, in order.
    timings = out["timings"]
    assert list(timings) == ["decompose_s", "retrieve_s", "answer_s"]
    assert all(v >= 0 for v in timings.values()) and timings["answer_s"] > 0


async def test_per_sub_question_answers_each_within_its_own_length_then_synthesises(pipeline_with):
    p = pipeline_with("canonical", sub_answer_max_tokens=3)
    answer = await p.ask(TWO_PART, answer_mode="per_sub_question")
    out = answer.to_json()
    assert out["answer_mode"] == "per_sub_question" and len(out["sub_answers"]) == 2
    *plans, synthesis = p.submitted
    assert [x.sampling.max_tokens for x in plans] == [3, 3] and synthesis.sampling.max_tokens == 8
    assert synthesis.system_prompt_id == "synthesize"
    assert list(out["timings"]) == ["decompose_s", "retrieve_s", "sub_answers_s", "synthesis_s"]
    assert out["timings"]["sub_answers_s"] > 0 and out["timings"]["synthesis_s"] > 0
    # A question may ask for a shorter answer, never a longer one; sub-answers stay within both.
    await p.ask(TWO_PART, answer_mode="per_sub_question", max_tokens=2)
    assert [x.sampling.max_tokens for x in p.submitted[3:]] == [2, 2, 2]
    await p.ask(TWO_PART, max_tokens=100)
    assert p.submitted[-1].sampling.max_tokens == 8


@pytest.mark.parametrize("figure_crops", [False, True], ids=["pages", "figure_crops"])
async def test_a_cached_one_prompt_answers_as_the_cold_one(pipeline_with, figure_crops):
    # fp32, greedy: the answer from the prefix cache is the answer computed cold, token for token; with
    # MMRAG_FIGURE_CROPS too, where a question about Figure 4 is shown its crop beside the other part's pages.
    p = pipeline_with("canonical", figure_crops=figure_crops)
    question = "What does Figure 4 show, and what is the retry limit?" if figure_crops else TWO_PART
    await p.engine.reset_prefix_cache()
    cold = await p.ask(question)
    warm = await p.ask(question)
    crops = [c.figure.image_key for c in cold.citations
             if c.figure is not None and c.image_key == str(c.figure.image_key)]
    assert len(crops) == figure_crops and all(k in p.submitted[0].images for k in crops)
    assert cold.usage.cached_image_tokens == 0 and warm.usage.cached_image_tokens >= cold.usage.image_tokens - 64
    assert warm.answer == cold.answer and warm.usage.completion_tokens == cold.usage.completion_tokens


async def test_auto_answers_per_sub_question_when_the_pages_do_not_fit_one_prompt_and_says_why(pipeline_with):
    # Parts answered in different documents: their pages together are more than one prompt holds.
    p = pipeline_with("canonical", max_images_per_prompt=2, top_k=2)
    answer = (await p.ask(APART)).to_json()
    assert answer["answer_mode"] == "per_sub_question" and len(answer["sub_answers"]) == 2
    assert "over MMRAG_MAX_IMAGES_PER_PROMPT=2" in answer["answer_mode_reason"]
    # Forced, one prompt drops the lowest-ranked pages it has no room for, and says which.
    forced = await p.ask(APART, answer_mode="one_prompt")
    assert len(p.submitted[-1].images) == 2 and forced.extra["answer_mode"] == "one_prompt"
    assert forced.extra["pages_left_out"] and len(forced.citations) == 2
    # A page budget: one prompt over the best two, the others left out, never cited.
    budget = pipeline_with("canonical", one_prompt_pages=2)
    two = await budget.ask(TWO_PART)
    assert two.extra["answer_mode"] == "one_prompt" and len(budget.submitted[-1].images) == 2
    assert {ImageKey.parse(c.image_key) for c in two.citations} == set(budget.submitted[-1].images)
    assert two.extra["pages_left_out"]
    # A context too small for every page with the answer: the same fallback.
    q = pipeline_with("canonical", max_model_len=900)
    assert "over MMRAG_MAX_MODEL_LEN=900" in (await q.ask(TWO_PART)).extra["answer_mode_reason"]


async def test_sub_questions_sharing_a_page_share_its_prefix(pipeline_with):
    # Both sub-questions retrieve the design review's first page (and the architecture page): canonical order
    # puts the shared pages first in both plans, and the scheduler sends the second after the first's prefill.
    p = pipeline_with("canonical")
    await p.engine.reset_prefix_cache()
    answer = await p.ask(TWO_PART, answer_mode="per_sub_question")
    assert answer.usage.cached_image_tokens >= 2 * (247 // 32 * 32) - 64


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
    empty, _ = wiring.pipeline(engine_settings.model_copy(update={"data_dir": tmp_path}), inprocess_engine)
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
    from core.keys import ImageKey
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
    """A pipeline wired for a layout (MMRAG_LAYOUT) and other settings on the session engine and index,
    recording every plan it submits (to the real scheduler)."""

    def build(layout: str, **settings):
        settings = engine_settings.model_copy(update={"answer_max_tokens": 8, "layout": layout, **settings})
        p, _ = wiring.pipeline(settings, pipeline.engine, client=pipeline.searcher.client)
        p.submitted = []
        scheduled = p.submit

        async def submit(plan: PromptPlan, **kwargs):
            p.submitted.append(plan)
            return await scheduled(plan, **kwargs)

        p.submit = submit
        return p

    return build


async def test_the_global_layout_answers_with_pages_in_the_popularity_order(pipeline_with):
    p = pipeline_with("global", answer_mode="per_sub_question")
    await p.engine.reset_prefix_cache()
    answer = await p.ask(TWO_PART)
    *plans, synthesis = p.submitted
    assert len(plans) == 2 and synthesis.system_prompt_id == "synthesize" and len(answer.extra["sub_answers"]) == 2
    assert all(plan.layout is Layout.GLOBAL and list(plan.images) == p.popularity.order(plan.images)
               for plan in plans)
    uses = [k for plan in plans for k in plan.images]
    assert {k: p.popularity.count(k) for k in uses} == {k: uses.count(k) for k in uses}
    # The pages both sub-questions retrieved were asked twice: they lead both plans, which share their prefix.
    assert answer.usage.cached_image_tokens >= 2 * (247 // 32 * 32) - 64
    again = await p.ask(TWO_PART)
    assert p.submitted[3:5] == plans and again.usage.cached_image_tokens > answer.usage.cached_image_tokens


async def test_the_per_page_layout_answers_from_one_prompt_per_page_and_one_synthesis(pipeline_with):
    p = pipeline_with("per_page")
    await p.engine.reset_prefix_cache()
    answer = await p.ask(TWO_PART)
    *plans, synthesis = p.submitted
    assert len(answer.sub_questions) == 2 and len(plans) == len(answer.extra["sub_answers"]) > 2
    assert all(len(plan.images) == 1 and plan.layout is Layout.PER_PAGE for plan in plans)
    assert {plan.text for plan in plans} == set(answer.sub_questions)
    assert synthesis.text.count(" from [") == len(plans)
    # Each sub-answer says which page it saw (the REST schema's SubAnswer.page).
    assert all(sub["page"] in synthesis.text for sub in answer.extra["sub_answers"])
    assert all(f"from [{c.doc}, page {c.page}]" in synthesis.text for c in answer.citations)
    # A page both sub-questions retrieved leads two prompts: the second reuses the first one's KV.
    assert answer.usage.cached_image_tokens >= 2 * (247 // 32 * 32) - 64


# --- one prompt: which pages, in which order, and when it does not fit ----------------------------------------


def test_the_union_keeps_each_sub_questions_best_pages_first_and_each_page_once():
    a1, a2, a3 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("a.pdf", 3, 0.7)
    b1, b2 = page_hit("b.pdf", 1, 0.95), page_hit("b.pdf", 2, 0.6)
    image = page_hit("question.png", 1).image_key
    assert union_pages([[a1, a2, a3], [b1, a1, b2]]) == [a1, b1, a2, a3, b2]
    assert union_pages([[a1, a2], [b1]], besides=(a1.image_key, image)) == [b1, a2]  # shown as the question's


def test_after_each_best_page_the_union_ranks_pages_by_how_far_they_stand_out_not_by_raw_score():
    """A vague sub-question's pages all score alike and high; a precise one's second page stands well clear of
    its candidates. The one-prompt budget goes to the page that stands out (Hit.margin), whatever its score."""
    precise = [replace(page_hit("a.pdf", 10, 3.4), margin=2.9), replace(page_hit("a.pdf", 11, 2.6), margin=2.1)]
    vague = [replace(page_hit("b.pdf", n, 2.2 - n / 100), margin=0.1) for n in range(1, 4)]
    assert union_pages([precise, vague])[:3] == [precise[0], vague[0], precise[1]]
    budget = choose_answer(AnswerMode.ONE_PROMPT, [precise, vague], misfit=lambda pages: None,
                           popularity=PagePopularity(), max_pages=3)
    assert {p.page for p in budget.pages if p.doc == "a.pdf"} == {10, 11} and len(budget.left_out) == 2


def test_auto_picks_one_prompt_when_it_fits_in_the_popularity_order_else_per_sub_question():
    a1, a2, b1 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("b.pdf", 1, 0.95)
    pop = PagePopularity()
    for _ in range(3):
        pop.observe([a2.image_key])
    hits = [[a1, a2], [b1, a1]]
    fits = lambda pages: None  # noqa: E731
    choice = choose_answer(AnswerMode.AUTO, hits, misfit=fits, popularity=pop)
    assert choice.mode is AnswerMode.ONE_PROMPT and choice.pages[0] == a2 and set(choice.pages) == {a1, a2, b1}
    assert [p.image_key for p in choice.pages] == pop.order([a1.image_key, a2.image_key, b1.image_key])
    two = lambda pages: None if len(pages) <= 2 else f"{len(pages)} images"  # noqa: E731
    fallback = choose_answer(AnswerMode.AUTO, hits, misfit=two, popularity=pop)
    assert (fallback.mode, fallback.why, fallback.pages) == (AnswerMode.PER_SUB_QUESTION, "3 images", ())
    forced = choose_answer(AnswerMode.ONE_PROMPT, hits, misfit=two, popularity=pop)
    assert set(forced.pages) == {a1, b1} and forced.left_out == (a2,)  # each sub-question's best page kept
    assert choose_answer(AnswerMode.PER_SUB_QUESTION, hits, misfit=fits, popularity=pop).mode is \
        AnswerMode.PER_SUB_QUESTION
    per_page = choose_answer(AnswerMode.AUTO, hits, misfit=fits, popularity=pop, layout=Layout.PER_PAGE)
    assert per_page.mode is AnswerMode.PER_SUB_QUESTION and "per_page" in per_page.why


def test_the_one_prompt_labels_every_image_then_lists_the_sub_questions_and_asks_last():
    a1, b3 = page_hit("a.pdf", 1), page_hit("b.pdf", 3)
    image = page_hit("question.png", 1).image_key
    plan = one_prompt_plan("Q?", ["q1", "q2"], [b3, a1], max_tokens=9, images=(image,))
    assert plan.images == (image, b3.image_key, a1.image_key) and plan.sampling.max_tokens == 9
    assert plan.text == ("Images, in the order shown:\nImage 1: sent with the question\nImage 2: [b.pdf, page 3]\n"
                         "Image 3: [a.pdf, page 1]\nAnswer each of these sub-questions from the images, citing "
                         "pages by their labels:\n1. q1\n2. q2\nQuestion: Q?")
    assert one_prompt_text("Q?", ["Q?"], [a1], 0) == "Images, in the order shown:\nImage 1: [a.pdf, page 1]\nQuestion: Q?"


def test_one_prompts_page_budget_keeps_each_sub_questions_best_pages_and_leaves_the_rest_out():
    a1, a2, a3 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("a.pdf", 3, 0.7)
    b1, b2 = page_hit("b.pdf", 1, 0.95), page_hit("b.pdf", 2, 0.6)
    hits, fits = [[a1, a2, a3], [b1, b2]], lambda pages: None  # noqa: E731
    for mode in (AnswerMode.AUTO, AnswerMode.ONE_PROMPT):
        choice = choose_answer(mode, hits, misfit=fits, popularity=PagePopularity(), max_pages=3)
        assert choice.mode is AnswerMode.ONE_PROMPT and set(choice.pages) == {a1, b1, a2}
        assert choice.left_out == (b2, a3)  # not shown, so not cited (the pipeline lists them in pages_left_out)
    assert len(choose_answer(AnswerMode.AUTO, hits, misfit=fits, popularity=PagePopularity()).pages) == 5


def test_per_image_gives_each_kept_page_its_own_prompt_with_its_sub_questions_and_a_share_of_the_length():
    a1, a2, b1 = page_hit("a.pdf", 1, 0.9), page_hit("a.pdf", 2, 0.8), page_hit("b.pdf", 1, 0.95)
    hits, fits = [[a1, a2], [b1, a1]], lambda pages: None  # noqa: E731
    choice = choose_answer(AnswerMode.PER_IMAGE, hits, misfit=fits, popularity=PagePopularity(), max_pages=2)
    assert choice.mode is AnswerMode.PER_IMAGE and choice.pages == (a1, b1) and choice.left_out == (a2,)
    image = page_hit("question.png", 1).image_key
    planned = per_image_plans("Q?", ["q1", "q2"], choice.pages, max_tokens=9, images=(image,), hits=hits)
    assert [p.plan.images for p in planned] == [(image, a1.image_key), (image, b1.image_key)]
    assert [p.plan.sampling.max_tokens for p in planned] == [5, 5]  # ceil(9 / 2): one answer's length in all
    assert "1. q1\n2. q2" in planned[0].plan.text  # a1 was retrieved by both sub-questions
    assert planned[1].plan.text.endswith("Image 2: [b.pdf, page 1]\nQuestion: Q?") and "q1" not in planned[1].plan.text
    # A page whose own prompt does not fit is left out; one page left is the one prompt itself.
    no_b = lambda pages: "too big" if pages[0] == b1 else None  # noqa: E731
    one = choose_answer(AnswerMode.PER_IMAGE, hits, misfit=no_b, popularity=PagePopularity(), max_pages=2)
    assert one.mode is AnswerMode.ONE_PROMPT and one.pages == (a1,) and set(one.left_out) == {a2, b1}


async def test_per_image_answers_from_one_prompt_per_page_joined_and_streamed_and_cached_as_cold(pipeline_with):
    """Each page leads its own prompt, so every one of them reuses its prefix when it recurs (not only the first
    of a prompt); fp32 greedy: the cached answer is the cold one, token for token."""
    p = pipeline_with("canonical")
    await p.engine.reset_prefix_cache()
    cold = await p.ask(TWO_PART, answer_mode="per_image")
    out = cold.to_json()
    assert out["answer_mode"] == "per_image" and len(out["image_answers"]) == len(p.submitted) > 1
    assert all(len(plan.images) == 1 for plan in p.submitted)
    assert {str(plan.images[0]) for plan in p.submitted} == {c.image_key for c in cold.citations} \
        == {a["image"] for a in out["image_answers"]}
    assert all(plan.sampling.max_tokens == -(-8 // len(p.submitted)) for plan in p.submitted)
    assert cold.answer == "".join(f"{'' if i == 0 else chr(10) * 2}{a['page']}: {a['answer']}"
                                  for i, a in enumerate(out["image_answers"]))
    assert cold.usage.cached_image_tokens == 0
    events = [e async for e in p.ask_events(TWO_PART, answer_mode="per_image")]
    done = events[-1]["answer"]
    assert "".join(e["text"] for e in events if e["event"] == "token") == done["answer"] == cold.answer
    # Every image, wherever it sat, came from the prefix cache (all but its last partial block).
    assert done["usage"]["cached_image_tokens"] >= done["usage"]["image_tokens"] - 32 * len(p.submitted)


async def test_an_answer_leases_the_pages_it_shows_until_its_last_token(engine_settings, pipeline_with):
    """While an answer runs, a deletion (a document's, `mmrag store gc`) keeps its pages' tokens: the store's
    delete finds them leased. The lease ends with the answer."""
    store = wiring.feature_store(engine_settings)
    p = pipeline_with("canonical")
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
    p = pipeline_with("canonical")
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


async def test_a_question_naming_a_figure_cites_it_and_with_figure_crops_is_shown_the_crop_alone(pipeline_with):
    """Issue 26: the sample paper's page 4 holds "Figure 4: hit rate by workload". Its citation names the figure
    either way; MMRAG_FIGURE_CROPS shows the figure's crop (its own key, fewer tokens) instead of the page."""
    question = "What does Figure 4 show about the hit rate by workload?"
    pages = pipeline_with("canonical")
    answer = await pages.ask(question)
    (cited,) = [c for c in answer.citations if c.figure is not None]
    assert (cited.doc, cited.page, cited.figure.region.number) == ("page_cache_paper.pdf", 4, 4)
    (plan,) = pages.submitted
    assert ImageKey.parse(cited.image_key) in plan.images and cited.figure.image_key not in plan.images

    crops = pipeline_with("canonical", figure_crops=True)
    shown = await crops.ask(question)
    (crop,) = [c for c in shown.citations if c.figure is not None]
    (plan,) = crops.submitted
    assert crop.image_key == str(crop.figure.image_key) and crop.figure.image_key in plan.images
    assert "[page_cache_paper.pdf, page 4], Figure 4: hit rate by workload (the figure alone)" in plan.text
    # Per image, the crop leads a prompt of its own and its part of the answer is headed by the figure.
    led = await crops.ask(question, answer_mode="per_image")
    alone = [plan for plan in crops.submitted[1:] if plan.images == (crop.figure.image_key,)]
    assert len(alone) == 1 and len(crops.submitted) - 1 == len(led.extra["image_answers"]) > 1
    assert "[page_cache_paper.pdf, page 4], Figure 4: hit rate by workload: " in led.answer
    assert ImageKey.parse(cited.image_key) not in plan.images  # the page itself is not shown
    # A question about what the page says around the figure is shown the page, the figure still cited.
    crops.submitted.clear()
    around = await crops.ask("According to the text, what does Figure 4 show about the hit rate by workload?",
                             answer_mode="one_prompt")
    (named,) = [c for c in around.citations if c.figure is not None]
    (plan,) = crops.submitted
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
    from core.keys import ResolutionPolicy
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
        assert said in one_prompt_text("Q?", ["What does Figure 4 show?"], [shown], 0)
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
    crops = pipeline_with("canonical", figure_crops=True, top_k=1)
    question = "What does Figure 4 show about the hit rate by workload?"
    try:
        answer = await crops.ask(question, tier="low")
    finally:
        for key in set(store.keys()) - before:  # the session's store, as it was (other tests count its entries)
            store.delete(key)
    (cited,) = [c for c in answer.citations if c.figure is not None]
    (plan,) = crops.submitted
    low = engine_settings.tier_table.policy("low")
    (shown,) = [k for k in plan.images if k.content_hash == cited.figure.image_key.content_hash]
    assert shown.policy == low and answer.extra["tier"] == {"name": "low", "fell_back": []}
    assert "[page_cache_paper.pdf, page 4], Figure 4: hit rate by workload (the figure alone)" in plan.text


async def test_with_figure_crops_warm_up_leaves_the_crop_a_question_is_shown_resident(pipeline_with):
    """With MMRAG_FIGURE_CROPS a prompt leads with a figure's crop, so warm-up (serving/warmup.leading_images, as
    `mmrag serve` and `mmrag warm` rank it) warms crops beside pages: after it, the crop a question about Figure 4
    is shown comes from the prefix cache, all but its last partial block; without crops only the page is warmed."""
    from adapters.qdrant import AsyncPageReader
    from serving.warmup import leading_images, rank_by_demand, warm

    # One page a sub-question: the canonical layout orders a prompt's images by key, so with other pages the crop
    # would lead only where its content hash sorts first.
    crops = pipeline_with("canonical", figure_crops=True, top_k=1)
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
