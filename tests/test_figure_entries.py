"""Figures as image entries of their own (issue 26): each figure crop keyed by its content like a page, ingested
once however many documents show it, referenced by its pages (store gc, deletion), re-encoded with them, counted
by `index check`, and named by the hits and citations it answers.

The documents are built here with pdfium (mmrag/devkit/pdfbuild.py PageBuilder): a report page and a slide that
paste the same JPEG chart at different places and sizes, with different text around it.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c
import pytest
from PIL import Image, ImageDraw

from mmrag.adapters.lexical import LexicalEncoder
from mmrag.core import figures as figure_rules
from mmrag.core.figures import FigureRegion, PageFigure, slide_title
from mmrag.core.keys import ImageKey
from mmrag.core.settings import Settings
from ingestion.figures import FIGURE_SCALE, crop_figures, detect_figures
from ingestion.pipeline import IngestReport
from mmrag import wiring
from rag.plans import cite
from retrieval.search import Channel, Hit
from mmrag.devkit.pdfbuild import PageBuilder, stored_turned

SLIDE = (792.0, 612.0)  # a landscape slide, points
# mmrag/core/figures.py hit_figure over the lexical channel's tokens, as retrieval names a hit's figure (Hit.of).
hit_figure = functools.partial(figure_rules.hit_figure, terms=LexicalEncoder().tokens)


def chart_jpeg() -> bytes:
    """A bar chart as a JPEG: what a team pastes into a report and a deck alike."""
    im = Image.new("RGB", (320, 200), "white")
    draw = ImageDraw.Draw(im)
    for k, h in enumerate((40, 90, 60, 150, 120, 170)):
        draw.rectangle((20 + 48 * k, 190 - h, 56 + 48 * k, 190), fill=(40 + 30 * k, 90, 200 - 20 * k))
    draw.line((10, 190, 310, 190), fill="black", width=2)
    out = io.BytesIO()
    im.save(out, "JPEG", quality=90)
    return out.getvalue()


def write_docs(folder: Path) -> Path:
    jpeg = chart_jpeg()
    report = PageBuilder()
    report.body(72, 4)
    report.image((150, 160, 450, 347.5), jpeg)
    report.text(150, 360, "Figure 3: Quarterly revenue by region, in millions.")
    report.body(410, 6)
    (folder / "report.pdf").write_bytes(report.bytes())
    deck = PageBuilder(*SLIDE)
    deck.text(60, 40, "Revenue grew in every region", size=24)
    deck.image((320, 140, 720, 390), jpeg)
    deck.text(320, 400, "Figure 1: Quarterly revenue by region.")
    deck.text(60, 160, "Europe leads the growth")
    (folder / "deck.pdf").write_bytes(deck.bytes())
    return folder


@dataclass(frozen=True)
class Ingested:
    settings: Settings
    report: IngestReport
    docs: Path


@pytest.fixture(scope="module")
def ingested(tiny_model, tmp_path_factory) -> Ingested:
    docs = write_docs(tmp_path_factory.mktemp("figure-docs"))
    settings = Settings(model=str(tiny_model), data_dir=tmp_path_factory.mktemp("figure-data"), ocr=False)
    ingestor = wiring.ingestor(settings)
    try:
        report = ingestor.run([docs / "report.pdf", docs / "deck.pdf"])
    finally:
        ingestor.index.client.close()
    return Ingested(settings, report, docs)


def copied(ingested: Ingested, to: Path, **update) -> Settings:
    """Settings on a copy of the ingested index and store (a test that changes them leaves the others theirs)."""
    data = to / "data"
    shutil.copytree(ingested.settings.storage.data_dir / "qdrant", data / "qdrant")
    shutil.copytree(ingested.settings.storage.data_dir / "features", data / "features",
                    ignore=shutil.ignore_patterns(".leases"))
    return ingested.settings.replace(**{"data_dir": data, **update})


def pages_of(settings: Settings) -> dict[str, object]:
    index = wiring.read_index(settings)
    try:
        return {p.doc: p for p in index.pages()}
    finally:
        index.client.close()


def test_the_same_picture_in_a_report_and_on_a_slide_is_one_figure_entry_and_one_forward(ingested):
    report = ingested.report
    assert not report.failed and report.pages == 2
    assert report.figures == 2 and report.figures_encoded == 1  # the slide's figure was stored already
    pages = pages_of(ingested.settings)
    (in_report,), (on_slide,) = pages["report.pdf"].figures, pages["deck.pdf"].figures
    assert pages["report.pdf"].image_key != pages["deck.pdf"].image_key  # the pages differ ...
    assert in_report.image_key == on_slide.image_key  # ... the figure is one key, keyed by the picture's own pixels
    assert (in_report.region.number, on_slide.region.number) == (3, 1)
    assert in_report.region.caption.startswith("Figure 3: Quarterly revenue")
    assert in_report.region.source == "raster" and in_report.image_tokens > 0
    assert max(abs(a - b) for a, b in zip(in_report.region.bbox_pt, (150, 160, 450, 347.5))) < 2
    store = wiring.feature_store(ingested.settings)
    assert store.contains(in_report.image_key)
    assert pages["report.pdf"].image_keys == (pages["report.pdf"].image_key, in_report.image_key)


def test_a_picture_crop_is_its_own_pixels_and_a_drawn_figure_renders_alone_at_a_fixed_scale():
    b = PageBuilder()
    b.image((100, 100, 300, 225), chart_jpeg())
    b.text(100, 235, "Figure 1: Revenue.")
    b.chart((100, 400, 400, 600))
    b.text(100, 610, "Figure 2: Latency.")
    page = b.open()
    picture, drawing = crop_figures(page, detect_figures(page), max_pixels=10**8)
    assert picture.image.size == (320, 200)  # the JPEG's own size, not its size on the page
    x0, y0, x1, y1 = drawing.region.bbox_pt
    assert abs(drawing.image.width - (x1 - x0) * FIGURE_SCALE) <= 1
    assert abs(drawing.image.height - (y1 - y0) * FIGURE_SCALE) <= 1
    assert page.get_cropbox() == (0.0, 0.0, 612.0, 792.0)  # put back after the render
    # A picture over the decoding bound is rendered instead of decoded.
    (small,) = crop_figures(page, detect_figures(page)[:1], max_pixels=1000)
    assert small.image.size != (320, 200)


def test_the_same_drawing_at_two_places_renders_alike_up_to_pdfium_rounding():
    """What a vector figure's key can promise when cropped as a region of its page (no page index: the fallback):
    its crop starts at its own corner, so the same drawing elsewhere on another page gives the same size and the
    same pixels up to a grey level where pdfium rounds absolute coordinates."""
    crops = []
    for box in ((100, 100, 400, 300), (180, 430, 480, 630)):
        b = PageBuilder()
        b.chart(box)
        b.text(box[0], box[3] + 10, "Figure 2: Latency.")
        page = b.open()
        crops += crop_figures(page, detect_figures(page), max_pixels=10**8)
    a, c = (np.asarray(x.image, dtype=int) for x in crops)
    assert a.shape == c.shape
    assert np.abs(a - c).max() <= 2


def test_a_drawing_of_the_pages_own_objects_is_cropped_alone_so_its_place_and_background_stay_out_of_its_key():
    """Issue 26: a vector figure is rendered from the page objects inside its region alone, moved to the origin
    (ingestion passes the page's index): the same chart on a plain report page and on a slide with a coloured
    background, a quarter and a half point elsewhere, is one key. Cropped as a region of its page (no index),
    the slide's background is in its pixels: two keys."""
    alone, as_region = [], []
    for background, box in ((None, (100, 100, 400, 300)), ((230, 240, 255), (180.25, 430.5, 480.25, 630.5))):
        b = PageBuilder()
        if background:
            b.background(background)
        b.chart(box)
        b.text(box[0], box[3] + 10, "Figure 2: Latency.")
        page = b.open()
        (region,) = detect_figures(page)
        assert region.source == "vector" and region.number == 2
        alone += crop_figures(page, [region], max_pixels=10**8, index=0)
        as_region += crop_figures(page, [region], max_pixels=10**8)
    assert alone[0].content_hash == alone[1].content_hash
    assert np.asarray(alone[1].image)[0, 0].tolist() == [255, 255, 255]  # the slide's background is not drawn
    assert as_region[0].content_hash != as_region[1].content_hash
    assert alone[0].image.size == as_region[0].image.size  # the chart's own extent (its frame) at FIGURE_SCALE


def test_a_line_chart_at_arbitrary_places_keeps_its_key_in_most_and_its_crop_is_not_anti_aliased():
    """The same drawing in another document sits at an arbitrary offset, not a quarter point away: its moved
    coordinates round differently in pdfium's float32. Drawn alone without anti-aliasing and moved back by its
    exact offset (fig-v4), a pixel changes only where an edge passes within that rounding of its centre, so most
    placements keep the key. (Anti-aliased and snapped to 1/256 pt, fig-v3, none of these ten did: every moved
    diagonal edge shifted some pixel's grey level.)"""
    rng = random.Random(0)
    places = [(100.0, 100.0)] + [(round(rng.uniform(40, 250), 2), round(rng.uniform(40, 400), 2)) for _ in range(10)]
    keys = []
    for x, y in places:
        b = PageBuilder()
        b.line_chart((x, y, x + 300, y + 200))
        b.text(x, y + 210, "Figure 3: Latency by hour.")
        page = b.open()
        (region,) = detect_figures(page)
        assert region.source == "vector" and region.number == 3
        (crop,) = crop_figures(page, [region], max_pixels=10**8, index=0)
        keys.append(crop.content_hash)
        colours = {tuple(px) for px in np.asarray(crop.image).reshape(-1, 3)}
        assert len(colours) <= 5, len(colours)  # white, the frame's black and the three series' own: no greys
    kept = sum(k == keys[0] for k in keys[1:])
    print(f"\nline chart at 10 arbitrary places: {kept} keep its key")
    assert kept >= 5, kept  # 7 here; fig-v3 kept none


@pytest.mark.parametrize("turn", [90, 270])
def test_a_landscape_page_stored_turned_gives_the_regions_and_keys_of_the_page_stored_landscape(turn):
    """A landscape page in a portrait document is stored portrait, its content turned, with /Rotate to show it
    upright. Its figures are found on the page as shown (their captions below them, their numbers) and cropped as
    shown, so the picture, the drawing, the included drawing and their keys are those of the same page stored
    landscape. Before, the
    turned page's drawing was found sideways, captioned with the wrong number and cropped sideways: other keys."""
    b = PageBuilder(792, 612)
    b.image((60, 80, 300, 230), chart_jpeg())
    b.text(60, 240, "Figure 1: Revenue by quarter.")
    b.line_chart((400, 80, 700, 280))
    b.text(400, 290, "Figure 2: Latency by hour.")
    drawing = PageBuilder(300, 150)
    drawing.chart((10, 10, 290, 140))
    b.form(drawing.bytes(), (60, 330))
    b.text(60, 490, "Figure 3: Throughput.")
    b.body(400, 5)
    shown = []
    for data in (b.bytes(), stored_turned(b.bytes(), turn)):
        page = pdfium.PdfDocument(data)[0]
        regions = detect_figures(page)
        crops = crop_figures(page, regions, max_pixels=10**8, index=0)
        shown.append([(r.source, r.number, [round(v, 1) for v in r.bbox_pt], c.image.size, c.content_hash)
                      for r, c in zip(regions, crops)])
    assert [(source, number) for source, number, *_ in shown[0]] == [("raster", 1), ("vector", 2), ("form", 3)]
    assert shown[1] == shown[0]


def test_an_object_mostly_inside_a_region_drawn_short_is_drawn_whole_and_a_background_is_not():
    """Detection may draw a region a little short of its drawing (vcd p34: a panel's tiles reach past it): an
    object at least half inside is drawn whole, past the region's edge, where cropping the page's region would
    cut it; the slide's background, which covers the region but lies mostly outside it, is left out."""
    b = PageBuilder()
    b.background((230, 240, 255))
    b.chart((100, 100, 400, 300))  # its frame is one rectangle, 300 x 200 pt
    page = b.open()
    (region,) = detect_figures(page)
    x0, y0, x1, y1 = region.bbox_pt
    short = dataclasses.replace(region, bbox_pt=(x0, y0, x1 - 40, y1))  # 40 pt short on the right
    (alone,) = crop_figures(page, [short], max_pixels=10**8, index=0)
    (as_region,) = crop_figures(page, [short], max_pixels=10**8)
    assert alone.image.width >= (x1 - x0) * FIGURE_SCALE - 2  # the frame and the last bars, whole
    assert as_region.image.width <= (x1 - 40 - x0) * FIGURE_SCALE + 2  # the page's region: cut at its edge
    assert np.asarray(alone.image)[0, 0].tolist() == [255, 255, 255]  # no background
    assert np.asarray(as_region.image)[0, 0].tolist() != [255, 255, 255]


def test_a_drawing_with_a_shading_object_is_cropped_alone_too():
    """A shading object (``sh``) has no matrix pdfium will give or set: it is moved as it is, beside the paths
    whose offsets are snapped; the same chart a fractional offset away is one key."""
    import pypdfium2 as pdfium

    from mmrag.devkit.pdfbuild import shaded_chart

    crops = []
    for dx, dy in ((0.0, 0.0), (36.5, -120.25)):
        page = pdfium.PdfDocument(shaded_chart(dx, dy))[0]
        assert pdfium_c.FPDF_PAGEOBJ_SHADING in [o.type for o in page.get_objects(max_depth=1)]
        (region,) = detect_figures(page)
        crops += crop_figures(page, [region], max_pixels=10**8, index=0)
    assert crops[0].content_hash == crops[1].content_hash
    r, g, b = (np.asarray(crops[0].image, dtype=int)[:, :, k] for k in range(3))
    assert ((r > 200) & (g < 60) & (b < 60)).any() and ((b > 200) & (r < 60) & (g < 60)).any()  # the shading


def test_a_drawing_pdfium_refuses_to_draw_alone_is_cropped_as_a_region_of_its_page(monkeypatch, caplog):
    """A page object pdfium will not move (a PdfiumError in the scratch copy) costs its figure its own
    coordinates, never its page: the crop falls back to the region of the page, and the log says so."""
    import pypdfium2 as pdfium

    from ingestion import figures

    def refuses(*args):
        raise pdfium.PdfiumError("Failed to get matrix of pageobject.")

    b = PageBuilder()
    b.chart((100, 100, 400, 300))
    page = b.open()
    regions = detect_figures(page)
    monkeypatch.setattr(figures, "_objects_alone", refuses)
    with caplog.at_level("WARNING", logger="ingestion.figures"):
        (crop,) = crop_figures(page, regions, max_pixels=10**8, index=0)
    (as_region,) = crop_figures(page, regions, max_pixels=10**8)
    assert crop.content_hash == as_region.content_hash
    assert "rendered as a region of its page: Failed to get matrix" in caplog.text


def test_store_gc_keeps_a_figure_entry_while_any_page_shows_it_and_frees_it_after(ingested, tmp_path):
    from mmrag.store_cmd import gc

    settings = copied(ingested, tmp_path)
    pages = pages_of(settings)
    figure_key = pages["report.pdf"].figures[0].image_key
    assert not gc(settings, dry_run=True).unreferenced
    index = wiring.read_index(settings)
    try:
        index.delete_document(pages["report.pdf"].doc_id)
        assert figure_key in index.referenced_keys()  # the slide still shows it
        index.delete_document(pages["deck.pdf"].doc_id)
    finally:
        index.client.close()
    freed = {k for k, _ in gc(settings, dry_run=True).unreferenced}
    assert figure_key in freed and pages["deck.pdf"].image_key in freed


def test_reencode_gives_figure_crops_the_new_encoders_keys_and_index_check_counts_them(ingested, tmp_path):
    from mmrag.index_cmd import check

    settings = copied(ingested, tmp_path, encoder_salt="figures-b")
    before = pages_of(settings)
    assert sum(e.figures for e in check(settings).encoders) == 2
    model = wiring.resolve_model(settings)
    encoder = wiring.vision_encoder(settings, model)
    index, store = wiring.read_index(settings), wiring.feature_store(settings)
    try:
        report = wiring.reencoder(settings, encoder=encoder, store=store, index=index).run()
    finally:
        index.client.close()
    assert report.reencoded == 2 and not report.skipped
    assert report.encoded == 3  # two pages and ONE figure: the slide's is the report's
    after = pages_of(settings)
    for doc, page in after.items():
        (figure,) = page.figures
        assert figure.image_key == encoder.key_for(before[doc].figures[0].image_key.content_hash)
        assert figure.region == before[doc].figures[0].region and store.contains(figure.image_key)
    (current,) = [e for e in check(settings).encoders if e.servable]
    assert (current.pages, current.figures) == (2, 2)


def test_reencode_leaves_a_page_whose_figure_crops_differently_as_it_was_and_says_why(ingested, tmp_path):
    """A page whose indexed figure no crop of its render matches any more (another detector made it) is not
    switched to keys that would name other pixels: it keeps its old keys, skipped with the reason."""
    from ingestion.reencode import FIGURES_CHANGED

    settings = copied(ingested, tmp_path, encoder_salt="figures-c")
    before = pages_of(settings)
    deck = before["deck.pdf"]
    (fig,) = deck.figures
    older = dataclasses.replace(fig, image_key=dataclasses.replace(fig.image_key, content_hash="f" * 64))
    index = wiring.read_index(settings)
    try:
        index.set_page_fields(deck.page_id, {"figures": [older.to_json()]})
        report = wiring.reencoder(settings, encoder=wiring.vision_encoder(settings, wiring.resolve_model(settings)),
                                  store=wiring.feature_store(settings), index=index).run()
    finally:
        index.client.close()
    assert report.reencoded == 1 and [(s.path, s.page, s.reason) for s in report.skipped] == \
        [(deck.path, deck.page, FIGURES_CHANGED)]
    after = pages_of(settings)
    assert after["deck.pdf"].image_key == deck.image_key and after["deck.pdf"].figures == (older,)
    assert after["report.pdf"].image_key != before["report.pdf"].image_key  # the other page moved on


def test_with_figures_off_pages_carry_none_and_their_fingerprint_says_so(tiny_model, ingested, tmp_path):
    settings = Settings(model=str(tiny_model), data_dir=tmp_path / "data", ocr=False, figures=False)
    ingestor = wiring.ingestor(settings)
    try:
        report = ingestor.run([ingested.docs / "report.pdf"])
        (page,) = ingestor.index.pages()
    finally:
        ingestor.index.client.close()
    assert report.figures == 0 and page.figures == () and "figures=off" in page.fingerprint


KEY = ImageKey.parse(f"img1-{'a' * 64}-{'ab' * 8}-px1-2")


def figure(number, caption, kind="figure") -> PageFigure:
    return PageFigure(FigureRegion(number, kind, caption, (10, 20, 110, 220), "vector"), KEY, 64)


def test_a_hit_names_the_figure_the_question_names_or_whose_caption_it_matches():
    f3 = figure(3, "Figure 3: Quarterly revenue by region, in millions.")
    t2 = figure(2, "Table 2: Latency of the page cache by batch size.", kind="table")
    figures = (f3, t2)
    assert hit_figure(figures, "What does Figure 3 show?") is f3
    assert hit_figure(figures, "what is in table 2?") is t2
    assert hit_figure(figures, "How does the page cache latency change with batch size?") is t2
    assert hit_figure(figures, "What does Figure 4 show?") is None
    assert hit_figure(figures, "Who wrote the cache?") is None  # one caption word is not a match
    assert hit_figure((), "What does Figure 3 show?") is None
    # A slide's lone uncaptioned chart is what the slide's title says; a captioned one keeps its caption.
    chart = PageFigure(FigureRegion(None, "image", "", (1, 2, 3, 4), "raster"), KEY, 64)
    title = "Headcount by team: where we stand"
    assert hit_figure((chart,), "What does the chart of headcount by team show?", title=title) is chart
    assert hit_figure((chart,), "What does the chart of headcount by team show?") is None
    assert hit_figure((chart,), "How is the team doing?", title=title) is None  # one shared term
    assert hit_figure((chart, chart), "headcount by team", title=title) is None  # not alone: the title is the slide's
    assert hit_figure((f3,), "headcount by team", title=title) is None
    assert slide_title(["Figure 2: Revenue", title]) == title and slide_title(["Table 1: x"]) == ""
    # Caption lines joined with the sentence after them are still labelled, so never a page's title.
    assert slide_title(["Figure 3 shows the throughput of the system", "TABLE IV costs by tier", "Table A.1 x"]) == ""
    assert slide_title(["Tablets sold in 2024", "x"]) == "Tablets sold in 2024"


def test_citations_carry_the_figure_of_the_pages_best_hit_on_a_figure():
    def hit(score, fig):
        return Hit("p1", "d", "report.pdf", 23, score, "", KEY, 64, "/r.pdf", figure=fig)

    f3 = figure(3, "Figure 3: Quarterly revenue by region.")
    (citation,) = cite([[hit(0.9, None)], [hit(0.7, f3)]])
    assert citation.score == 0.9 and citation.figure is f3
    assert citation.to_json()["figure"] == {"number": 3, "kind": "figure", "caption": f3.region.caption,
                                            "bbox": [10.0, 20.0, 110.0, 220.0]}
    (plain,) = cite([[hit(0.9, None)]])
    assert plain.figure is None and plain.to_json()["figure"] is None


def test_a_captioned_figure_is_a_point_of_its_own_that_no_page_reader_counts(ingested):
    index = wiring.read_index(ingested.settings)
    try:
        figures = index.figure_points(with_vectors=True)
        pages = {p.page_id: p for p in index.pages()}
        assert index.count() == len(pages) == 2 and len(index.points()) == 2
    finally:
        index.client.close()
    assert len(figures) == 2  # one per captioned figure, beside the two pages
    for point in figures:
        parent = pages[point.payload["parent"]]
        assert point.payload["kind"] == "figure" and point.payload["figure_index"] == 0
        assert point.payload["doc"] == parent.doc and point.payload["image_key"] == str(parent.image_key)
        assert set(point.vector) == {"text"}  # found by its caption's dense vector


async def test_a_question_about_a_figure_finds_its_page_with_the_figure_named(ingested):
    searcher = wiring.searcher(ingested.settings)
    try:
        (hits,) = await searcher.search_many(["What does Figure 3 show about quarterly revenue by region?"], top_k=2)
        every = await searcher.search_channels(["quarterly revenue by region"], top_k=2)
    finally:
        await searcher.client.close()
    assert hits[0].doc == "report.pdf" and hits[0].figure is not None and hits[0].figure.region.number == 3
    searcher = wiring.searcher(ingested.settings)
    try:
        (unrelated,) = await searcher.search_many(["How long are backups retained?"], top_k=2)
    finally:
        await searcher.client.close()
    assert unrelated and all(h.figure is None for h in unrelated)  # found near a figure is not being about it
    assert "figure" not in {c.value for c in every}  # a part of the fusion, like the caption channel
    assert len({h.page_id for h in every[Channel.HYBRID][0]}) == len(every[Channel.HYBRID][0])  # pages, once


def test_deleting_a_document_removes_its_figure_points_and_reencode_updates_them(ingested, tmp_path):
    settings = copied(ingested, tmp_path, encoder_salt="figures-c")
    encoder = wiring.vision_encoder(settings, wiring.resolve_model(settings))
    index, store = wiring.read_index(settings), wiring.feature_store(settings)
    try:
        wiring.reencoder(settings, encoder=encoder, store=store, index=index).run()
        pages = {p.page_id: p for p in index.pages()}
        for point in index.figure_points():  # the page's payload, copied onto its figure point, switched with it
            assert point.payload["image_key"] == str(pages[point.payload["parent"]].image_key)
            assert point.payload["figures"] == [f.to_json() for f in pages[point.payload["parent"]].figures]
        report = next(p for p in pages.values() if p.doc == "report.pdf")
        index.delete_document(report.doc_id)
        assert [p.payload["doc"] for p in index.figure_points()] == ["deck.pdf"]
    finally:
        index.client.close()


def test_a_figure_point_is_found_by_the_words_drawn_in_it_and_the_sentences_naming_it_on_other_pages(
        tiny_model, tmp_path, monkeypatch):
    """Issue 44's sources of a figure point's text, through ingestion: the labels drawn inside a chart and a sentence
    three pages on that says what the figure shows are in the text its dense vector embeds; another figure's
    sentence is not."""
    import ingestion.pipeline
    from mmrag.devkit.pdfbuild import join_pages

    first = PageBuilder()
    first.body(72, 3)
    first.chart((120, 150, 480, 400))
    first.text(300, 380, "Pressure (kPa)")
    first.text(120, 415, "Figure 2: The loop.")
    first.body(460, 4)
    pages = [first.bytes()]
    for text in ("Nothing about figures here.", "Figure 7 is elsewhere.",
                 "As Figure 2 shows, the radon half-life does not depend on pressure."):
        page = PageBuilder()
        page.text(72, 72, text)
        pages.append(page.bytes())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "loop.pdf").write_bytes(join_pages(pages))
    texts = []
    real = ingestion.pipeline.figure_text
    monkeypatch.setattr(ingestion.pipeline, "figure_text", lambda *a, **k: texts.append(real(*a, **k)) or texts[-1])
    settings = Settings(model=str(tiny_model), data_dir=tmp_path / "data", ocr=False)
    ingestor = wiring.ingestor(settings)
    try:
        report = ingestor.run([tmp_path / "docs" / "loop.pdf"])
        (point,) = ingestor.index.figure_points(with_vectors=True)
        embed = ingestor.text_embedder.embed
    finally:
        ingestor.index.client.close()
    assert report.figures == 1 and point.payload["page"] == 1
    (text,) = texts
    assert text.startswith("Figure 2: The loop.") and "Pressure (kPa)" in text
    assert text.endswith("As Figure 2 shows, the radon half-life does not depend on pressure.")
    assert "Figure 7" not in text and "Nothing about" not in text
    (expected, caption_only) = embed([text, "Figure 2: The loop."])
    assert np.allclose(point.vector["text"], expected, atol=1e-5)  # what the point is found by
    assert not np.allclose(point.vector["text"], caption_only, atol=1e-3)
