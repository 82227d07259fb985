"""The late-interaction page-image channel end to end (issue 25): the tiny random-weight ColQwen2 (built offline)
as MMRAG_PAGE_RETRIEVER, sample pages ingested with their multi-vectors in local Qdrant, and searched in two
stages (the mean-pooled vector prefetches, MaxSim re-ranks) through the same PageSearcher as the text channels."""

from __future__ import annotations

import numpy as np
import pytest

from mmrag.adapters.late import maxsim, mean_pool
from mmrag.core.settings import Settings
from mmrag.devkit.tiny_colqwen import ensure_tiny_colqwen2
from retrieval.search import Channel
from mmrag.adapters.qdrant import IS_FIGURE, PAGES_ONLY
from mmrag.core.payload import FIGURE_INDEX, FIGURE_PARENT, PagePayload
from qdrant_client.models import Filter

CORPUS = ("q3_quarterly_report.pdf", "allhands_02_q3_revenue.png")


@pytest.fixture(scope="module")
def colqwen(tmp_path_factory):
    return ensure_tiny_colqwen2(tmp_path_factory.mktemp("colqwen") / "tiny-colqwen2")


def ingest(settings: Settings, paths) -> None:
    from mmrag import wiring

    ingestor = wiring.ingestor(settings)
    try:
        report = ingestor.run(list(paths))
    finally:
        ingestor.index.client.close()
    assert not report.failed, report.failed


@pytest.fixture(scope="module")
def late_settings(tmp_path_factory, tiny_model, sample_corpus, colqwen) -> Settings:
    settings = Settings(model=str(tiny_model), data_dir=tmp_path_factory.mktemp("late-data"), ocr=False,
                        page_retriever=str(colqwen), page_prefetch=20, candidate_k=20, top_k=3)
    ingest(settings, [sample_corpus / f for f in CORPUS])
    return settings


async def test_image_channel_ranks_pages_by_maxsim_over_their_stored_multi_vectors(late_settings):
    from mmrag import wiring

    searcher = wiring.searcher(late_settings)
    try:
        assert searcher.image_channel and "random weights" in searcher.image_channel_name
        question = "What was the revenue by region in the third quarter?"
        hits = await searcher.search(question, channels=Channel.IMAGE, top_k=10)
        points, _ = await searcher.client.scroll(searcher.collection, limit=100, with_vectors=True,
                                                 scroll_filter=PAGES_ONLY)
        assert len(hits) == len(points) > 3  # prefetch (20) covers every page: the two stages are exhaustive here
        query = searcher.late.embed_queries([question])[0]
        expected = {str(p.id): maxsim(query, np.array(p.vector["page"])) for p in points}
        crops, _ = await searcher.client.scroll(searcher.collection, limit=100, with_vectors=True,
                                                scroll_filter=Filter(must=[IS_FIGURE]))
        assert crops  # the report's figures, each a point with its crop's multi-vectors
        for c in crops:  # a page scores as the better of itself and its best crop
            parent = c.payload[FIGURE_PARENT]
            expected[parent] = max(expected[parent], maxsim(query, np.array(c.vector["page"])))
        assert {h.page_id: h.score for h in hits} == pytest.approx(expected, rel=1e-4)
        assert [h.score for h in hits] == pytest.approx(sorted(expected.values(), reverse=True), rel=1e-4)
        for p in [*points, *crops]:  # the prefetch vector is the mean of the rows, normalised
            assert np.allclose(p.vector["page_mean"], mean_pool(np.array(p.vector["page"])), atol=1e-5)
        fused = await searcher.search(question)
        assert fused and len(fused) == 3
    finally:
        await searcher.client.close()


async def test_a_figure_crop_found_by_its_pixels_brings_its_page_with_the_figure_named(late_settings):
    """Issue 26: figure points carry their crop's page-image vectors; the page-image channel searches them
    beside the pages, and a page found through its crop (the crop scoring at least the page) names that figure.
    A query that is the crop's own multi-vector finds exactly that crop (random weights: only identity is sure)."""
    from mmrag import wiring
    from retrieval.search import QueryVectors

    searcher = wiring.searcher(late_settings)
    try:
        crops, _ = await searcher.client.scroll(searcher.collection, limit=100, with_vectors=True,
                                                scroll_filter=Filter(must=[IS_FIGURE]))
        pages, _ = await searcher.client.scroll(searcher.collection, limit=100, scroll_filter=PAGES_ONLY)
        figures = sum(len(PagePayload.from_qdrant(p.payload).figures) for p in pages)
        assert figures and len(crops) == figures  # with the image channel on, every figure is a point, captioned or not
        for crop in crops:
            query = QueryVectors(late=[np.array(crop.vector["page"])])
            [hits] = await searcher.search_vectors(["the chart"], query, top_k=3)
            best = hits[0]
            assert best.page_id == crop.payload[FIGURE_PARENT]
            page = PagePayload.from_qdrant(crop.payload)
            assert best.figure == page.figures[crop.payload[FIGURE_INDEX]]
    finally:
        await searcher.client.close()


async def test_a_narrow_prefetch_re_ranks_only_what_the_pooled_vector_found(late_settings):
    from mmrag import wiring

    narrow = late_settings.replace(**{"page_prefetch": 3, "candidate_k": 3})
    searcher = wiring.searcher(narrow)
    try:
        question = "Which slide shows the quarterly revenue chart?"
        hits = await searcher.search(question, channels=Channel.IMAGE, top_k=3)
        query = mean_pool(searcher.late.embed_queries([question])[0])
        prefetched = set()  # the 3 pages and the 3 figure crops the pooled vector finds first, as their pages
        for flt in (PAGES_ONLY, Filter(must=[IS_FIGURE])):
            points, _ = await searcher.client.scroll(searcher.collection, limit=100, with_vectors=True,
                                                     scroll_filter=flt)
            by_mean = sorted(points, key=lambda p: -float(np.dot(query, p.vector["page_mean"])))[:3]
            prefetched |= {str(p.payload.get(FIGURE_PARENT, p.id)) for p in by_mean}
        assert len(hits) == 3 and {h.page_id for h in hits} <= prefetched
    finally:
        await searcher.client.close()


def test_token_pooling_stores_fewer_rows_per_page(tmp_path, tiny_model, sample_corpus, colqwen, late_settings):
    pooled = Settings(model=str(tiny_model), data_dir=tmp_path, ocr=False, page_retriever=str(colqwen),
                      page_pool_factor=3)
    ingest(pooled, [sample_corpus / CORPUS[0]])
    from mmrag.adapters.qdrant import open_qdrant

    rows = {}
    for name, settings in (("full", late_settings), ("pooled", pooled)):
        client = open_qdrant("", settings.storage.qdrant_path)
        try:
            points, _ = client.scroll(settings.storage.qdrant_collection, limit=100, with_vectors=True,
                                      with_payload=True,
                                      scroll_filter=PAGES_ONLY)
            rows[name] = {(p.payload["doc"], p.payload["page"]): len(p.vector["page"]) for p in points}
        finally:
            client.close()
    for page, n in rows["pooled"].items():
        assert n == pytest.approx(rows["full"][page] / 3, abs=1)


def test_a_page_retriever_folder_and_clip_weights_together_name_the_fix(colqwen, tmp_path):
    weights = tmp_path / "clip.bin"
    weights.write_bytes(b"x")
    with pytest.raises(ValueError, match="unset MMRAG_CLIP_WEIGHTS"):
        Settings(page_retriever=str(colqwen), clip_weights=weights)
