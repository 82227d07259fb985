"""The lexical channel and captions end to end (issue 25): a manual-like PDF made here, with a caption page, pages
that only mention its figure, a rare option name and text-layer artefacts, ingested with the tiny model into local
Qdrant and searched through PageSearcher, channel by channel and fused; then `mmrag retrieval eval --labels`."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.backends.backend_pdf import PdfPages  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from mmrag.adapters.embed import TextEmbedder  # noqa: E402
from mmrag.adapters.qdrant import open_async_qdrant  # noqa: E402
from mmrag.core.settings import Settings  # noqa: E402
from mmrag.retrieval_cmd import retrieval_app  # noqa: E402
from retrieval.search import Channel, PageSearcher  # noqa: E402
from tests.conftest import record_batches  # noqa: E402

FILLER = ("The terminal driver writes the plot to the selected output device after every replot command. "
          "Settings persist until they are reset, and the defaults are restored by the reset command. ")
PAGES = [
    ["Chapter 3: Output terminals", FILLER, "As Figure 12 shows, the cache warms quickly.", FILLER],
    ["Axis tics", "The option set_xtics_rotate turns the labels of the x axis by the given angle.", FILLER],
    ["Throughput measurements", FILLER, "Figure 12: Throughput of the prefix cache by block size", FILLER],
    ["Colour maps", "Palettes are deﬁned by a list of control points; the ﬂag ends the de-", "ﬁnition. " + FILLER],
    ["Summary", FILLER, "See Figure 12 for the measured throughput.", FILLER],
]


def write_manual(path: Path) -> Path:
    with PdfPages(path) as pdf:
        for lines in PAGES:
            fig = Figure(figsize=(8.27, 11.69))
            y = 0.92
            for line in lines:
                for chunk in [line[i:i + 90] for i in range(0, len(line), 90)]:
                    fig.text(0.08, y, chunk, fontsize=9)
                    y -= 0.03
            pdf.savefig(fig)
    return path


@pytest.fixture(scope="module")
def manual_docs(tmp_path_factory) -> Path:
    docs = tmp_path_factory.mktemp("manual-docs")
    write_manual(docs / "manual.pdf")
    return docs


@pytest.fixture(scope="module")
def manual_settings(tmp_path_factory, tiny_model, manual_docs) -> Settings:
    from mmrag import wiring

    docs = manual_docs
    settings = Settings(model=str(tiny_model), data_dir=tmp_path_factory.mktemp("manual-data"), ocr=False)
    ingestor = wiring.ingestor(settings)
    try:
        report = ingestor.run([docs])
    finally:
        ingestor.index.client.close()
    assert not report.failed and report.pages == len(PAGES)
    return settings


@pytest.fixture
async def searcher(manual_settings):
    client = open_async_qdrant("", manual_settings.storage.qdrant_path)
    yield PageSearcher(client, manual_settings.storage.qdrant_collection, TextEmbedder(), None, top_k=5, candidate_k=5)
    await client.close()


async def test_a_question_naming_a_figure_reaches_the_page_with_its_caption_not_those_that_mention_it(searcher):
    (lexical,) = await searcher.search_many(["What does Figure 12 show?"], channels=Channel.LEXICAL)
    assert lexical[0].page == 3
    (fused,) = await searcher.search_many(["What does Figure 12 show?"])
    assert fused[0].page == 3


async def test_captions_are_stored_in_the_page_payload(searcher):
    (hits,) = await searcher.search_many(["Throughput of the prefix cache by block size"])
    page = next(h for h in hits if h.page == 3)
    from mmrag.adapters.qdrant import AsyncPageReader

    stored = await AsyncPageReader(searcher.client, searcher.collection).get(page.page_id)
    assert stored.captions == ("Figure 12: Throughput of the prefix cache by block size",)


async def test_a_rare_option_name_is_found_by_the_lexical_channel(searcher):
    for question in ("Which option is set_xtics_rotate?", "how do I rotate the x tic labels with set_xtics_rotate"):
        (lexical,) = await searcher.search_many([question], channels=Channel.LEXICAL)
        assert lexical[0].page == 2, question


async def test_ligatures_and_line_break_hyphens_are_normalised_at_ingest_and_in_questions(searcher):
    (hits,) = await searcher.search_many(["palettes defined by control points definition"], channels=Channel.LEXICAL)
    top = hits[0]
    assert top.page == 4
    assert "defined" in top.text and "definition" in top.text and "ﬁ" not in top.text and "ﬂag" not in top.text


async def test_docs_filters_apply_to_every_channel(searcher):
    (hits,) = await searcher.search_many(["Figure 12 throughput"], doc_filter=["manual.pdf"])
    assert hits and {h.doc for h in hits} == {"manual.pdf"}


def test_cli_eval_with_labels_ingests_the_folder_and_scores_each_channel_and_the_citations(
        manual_settings, manual_docs, tmp_path):
    labels = tmp_path / "labels.jsonl"
    rows = [{"question": "What does Figure 12 show?", "pages": [{"doc": "manual.pdf", "page": 3}], "kind": "figure"},
            {"question": "Which option rotates the x tic labels (set_xtics_rotate)?",
             "pages": [{"doc": "manual.pdf", "page": 2}], "kind": "text"},
            {"question": "Compare the tics option and the colour palettes",
             "pages": [{"doc": "manual.pdf", "page": 2}, {"doc": "manual.pdf", "page": 4}], "needs": "all",
             "kind": "text"}]
    labels.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {"MMRAG_DATA_DIR": str(manual_settings.storage.data_dir), "MMRAG_MODEL": str(manual_settings.model.name),
           "MMRAG_OCR": "false"}
    result = CliRunner().invoke(retrieval_app, ["eval", "--labels", str(labels), str(manual_docs), "--json",
                                                "--sweep"], env=env)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(out["channels"]) == {"text", "lexical", "hybrid", "cited"}
    assert out["channels"]["lexical"]["recall@1"] >= 2 / 3 and out["channels"]["cited"]["n_multi"] == 1
    assert set(out["by_kind"]["hybrid"]) == {"figure", "text"} and len(out["sweep"]) >= 8
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x", "pages": [{"doc": "absent.pdf", "page": 1}]}\n')
    result = CliRunner().invoke(retrieval_app, ["eval", "--labels", str(bad), str(manual_docs)], env=env)
    assert result.exit_code != 0 and "absent.pdf:1" in result.output


async def test_sub_questions_lean_on_their_question_in_the_same_round_trip(searcher, monkeypatch):
    from retrieval.search import CONTEXT_WEIGHT

    question = "Which option rotates the x tic labels, and what does Figure 12 show?"
    subs = ["Which option rotates the x tic labels?", "What does Figure 12 show?"]
    alone = await searcher.search_many(subs, top_k=5)
    (whole,) = await searcher.search_many([question], top_k=5)
    calls = record_batches(monkeypatch, searcher.client)
    leaning = await searcher.search_many(subs, top_k=5, context=question)
    assert len(calls) == 1 and len(leaning) == 2  # the question is searched beside them, not answered
    checked = 0
    for own, lean in zip(alone, leaning):
        both = {h.page_id for h in own} & {h.page_id for h in lean} & {h.page_id for h in whole}
        expected = {h.page_id: h.score for h in own}
        for h in whole:
            if h.page_id in both:
                assert {x.page_id: x.score for x in lean}[h.page_id] == pytest.approx(
                    expected[h.page_id] + CONTEXT_WEIGHT * h.score)
                checked += 1
    assert checked >= 2


async def test_each_hit_carries_its_margin_over_the_median_of_its_querys_candidates(searcher):
    """Hit.margin (what one prompt's page budget ranks by, rag/plans.union_pages): the hit's score minus the
    median score of the candidates its query drew, fused or from one channel. Fused hits keep their margins
    under a shallower top_k (the channels are asked MMRAG_CANDIDATE_K deep either way)."""
    questions = ["Which option rotates the x tic labels?", "What does Figure 12 show?"]
    for channel in (Channel.HYBRID, Channel.LEXICAL):
        every = await searcher.search_many(questions, top_k=5, channels=channel)
        first = await searcher.search_many(questions, top_k=2, channels=channel)
        for hits, top in zip(every, first):
            median = float(np.median([h.score for h in hits]))
            assert [h.margin for h in hits] == pytest.approx([h.score - median for h in hits])
            if channel is Channel.HYBRID:
                assert [h.margin for h in top] == pytest.approx([h.margin for h in hits[:len(top)]])
            assert hits[0].margin > 0 or len(hits) == 1  # a lone lexical match is its own median


async def test_a_repeated_query_is_searched_with_the_vectors_it_had_and_no_encoder_forward(searcher, monkeypatch):
    """The searcher remembers its last queries' dense vectors (retrieval/search.QUERY_MEMO): a repeated question
    costs no text-encoder forward, and finds the same pages with the same scores, whatever batch it came in."""
    from retrieval import search

    embedded: list[list[str]] = []
    embed = searcher.text_embedder.embed
    monkeypatch.setattr(searcher.text_embedder, "embed", lambda texts: embedded.append(list(texts)) or embed(texts))
    first = await searcher.search_many(["Which option rotates the x tic labels?", "What does a memo table hold?"])
    again = await searcher.search_many(["What does a memo table hold?", "Which option rotates the x tic labels?"])
    assert embedded == [["Which option rotates the x tic labels?", "What does a memo table hold?"]]
    # The same pages in the same order; the same fused scores but for the last bit of a float64: with AVX2
    # kernels (make test-avx2) the fusion's sums came out 1 ulp apart by the query's place in the batch
    # (0.4370621562808329 against 0.437062156280833), with the very same vectors.
    assert [[h.page_id for h in hs] for hs in again] == [[h.page_id for h in hs] for hs in first[::-1]]
    assert [[h.score for h in hs] for hs in again] == [pytest.approx([h.score for h in hs], rel=1e-12, abs=1e-15)
                                                        for hs in first[::-1]]
    monkeypatch.setattr(search, "QUERY_MEMO", 1)  # the bound: only the last text is kept
    await searcher.search_many(["What is a third question about axes?"])
    await searcher.search_many(["Which option rotates the x tic labels?"])
    assert embedded[1:] == [["What is a third question about axes?"], ["Which option rotates the x tic labels?"]]
