"""The RAG pipeline end to end on the session engine and index: sub-questions, pages, cited answers."""

from __future__ import annotations

import pytest

from rag.decompose import BadQuestionError
from rag.llama import as_query_engine
from mmrag import wiring
from rag.pipeline import build_plans, cite
from retrieval.search import NoDocumentsError, UnknownDocumentError
from core.engine import Layout


@pytest.fixture(scope="module")
async def pipeline(engine_settings, ingested, inprocess_engine):
    p, _ = wiring.pipeline(engine_settings.model_copy(update={"answer_max_tokens": 8}), inprocess_engine)
    yield p
    await p.searcher.client.close()


async def test_a_two_part_question_gets_sub_questions_pages_and_citations(pipeline):
    answer = await pipeline.ask("What is the retry limit and the timeout of the ingest service?")
    out = answer.to_json()
    assert out["sub_question_source"] == "rules"  # the random model's JSON is never grounded
    assert len(out["sub_questions"]) == 2
    assert out["citations"] and all({"page_id", "doc", "page", "score"} == c.keys() for c in out["citations"])
    scores = [c["score"] for c in out["citations"]]
    assert scores == sorted(scores, reverse=True)
    assert len(out["sub_answers"]) == 2
    assert out["usage"]["image_tokens"] > 0 and out["model"]["random_weights"] is True


async def test_sub_questions_sharing_a_page_share_its_prefix(pipeline):
    # Both sub-questions retrieve the design review's first page (and the architecture page): canonical order
    # puts the shared pages first in both plans, and the scheduler sends the second after the first's prefill.
    await pipeline.engine.reset_prefix_cache()
    answer = await pipeline.ask("What is the retry limit and the timeout of the ingest service?")
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
