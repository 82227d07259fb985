"""Figure regions found from a PDF page's own structure (ingestion.figures) and the FigureRegion contract.

The PDFs are built here with pdfium itself: image objects, path objects and standard-font text objects
placed at known positions, saved and opened again, as an ingested PDF would be.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw, ImageFont

from mmrag.bench.figures.evaluate import match
from mmrag.core.figures import (FIGURE_TEXT_CHARS, FIGURE_WORDS_CHARS, FigureRegion, figure_mentions, figure_text,
                                figure_words, iou, union_box)
from mmrag.core.settings import DocumentSettings
from mmrag.devkit.pdfbuild import PageBuilder
from ingestion.figures import FigureBudgetError, _cluster, detect_figures
from ingestion.loaders import open_document
from ingestion.ocr import ocr_available


def close(a, b, tol=2.0) -> bool:
    return all(abs(u - v) <= tol for u, v in zip(a, b))


def test_a_picture_captioned_figure_3_below_is_one_region_numbered_3_where_it_was_placed():
    b = PageBuilder()
    b.body(72, 4)
    b.image((150, 160, 450, 360))
    b.text(150, 372, "Figure 3: Throughput of the page cache under load.")
    b.body(420, 4)
    (region,) = detect_figures(b.open())
    assert region.number == 3 and region.kind == "figure" and region.source == "raster"
    assert region.caption.startswith("Figure 3: Throughput")
    assert close(region.bbox_pt, (150, 160, 450, 360))


def test_a_vector_chart_of_many_paths_is_one_region():
    b = PageBuilder()
    b.body(72, 3)
    b.chart((120, 150, 480, 400))
    b.body(440, 5)
    (region,) = detect_figures(b.open())
    assert region.source == "vector" and region.number is None and region.kind == "figure"
    assert close(region.bbox_pt, (120, 150, 480, 400), tol=3)


def test_a_scatter_plot_of_thousands_of_marks_in_a_frame_is_one_region():
    # The clustering sweep meets each mark's neighbours only (columns as wide as the gap); before, it compared
    # each with every box in reach, quadratic in the marks' density (32,000 marks: 3.9 s against 0.6 s now).
    b = PageBuilder()
    b.rect((100, 100, 500, 400))
    for k in range(4000):
        x, y = 102 + (k * 97) % 396, 102 + (k * 61) % 296
        b.rect((x, y, x + 1.5, y + 1.5), fill=True)
    b.text(100, 410, "Figure 1: Four thousand marks.")
    (region,) = detect_figures(b.open())
    assert region.source == "vector" and region.number == 1
    assert iou(region.bbox_pt, (100, 100, 500, 400)) > 0.97


def _cluster_pairwise(boxes, gap):
    """The definition: every pair compared (boxes touching within ``gap`` are one cluster), clusters in the order
    of their first box, each the union of its boxes in index order."""
    parent = list(range(len(boxes)))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i, a in enumerate(boxes):
        for j in range(i):
            b = boxes[j]
            if max(a[0], b[0]) - min(a[2], b[2]) <= gap and max(a[1], b[1]) - min(a[3], b[3]) <= gap:
                parent[find(i)] = find(j)
    merged = {}
    for i, b in enumerate(boxes):
        r = find(i)
        merged[r] = union_box(merged[r], b) if r in merged else b
    return list(merged.values())


_coord = st.floats(0, 300, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_coord, _coord, st.floats(0, 120), st.floats(0, 40)), max_size=60),
       st.sampled_from([0.0, 0.5, 4.0, 24.0]))
def test_the_column_sweep_clusters_exactly_as_comparing_every_pair(corners, gap):
    boxes = [(x, y, x + w, y + h) for x, y, w, h in corners]
    assert _cluster(boxes, gap) == _cluster_pairwise(boxes, gap)


@pytest.mark.parametrize("turn", [0, 90, 180, 270])
def test_a_figures_box_is_where_the_rendered_page_shows_it_whatever_the_rotate_and_crop_box(turn):
    """Boxes are reported on the page as shown (what its image and a citation's outline use): turned by /Rotate
    and relative to a crop box that does not start at the origin. pdfium gives objects in PDF space, which neither
    turns nor crops; before, a turned page's boxes were in the wrong place (IoU 0) and a cropped one's shifted."""
    import io

    import numpy as np
    import pypdfium2 as pdfium

    b = PageBuilder()
    b.image((100, 100, 300, 225))  # navy
    b.text(100, 235, "Figure 1: Revenue.")
    pdf = pdfium.PdfDocument(b.bytes())
    pdf[0].set_rotation(turn)
    pdf[0].set_cropbox(30, 20, 580, 770)
    out = io.BytesIO()
    pdf.save(out)
    page = pdfium.PdfDocument(out.getvalue())[0]
    (region,) = detect_figures(page)
    pixels = np.asarray(page.render(scale=1).to_pil().convert("RGB")).astype(int)
    ys, xs = np.nonzero((pixels[:, :, 2] > 100) & (pixels[:, :, 0] < 50))
    assert iou(region.bbox_pt, (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)) > 0.99


def test_a_plain_text_page_with_a_header_rule_has_no_region():
    b = PageBuilder()
    b.text(72, 40, "Chapter 3: Tutorial")
    b.line(72, 56, 540)
    b.body(80, 40)
    assert detect_figures(b.open()) == []


def test_two_figures_on_a_page_come_in_reading_order_with_their_own_numbers():
    b = PageBuilder()
    b.chart((150, 80, 450, 280))
    b.text(150, 292, "Figure 1: Latency by batch size.")
    b.body(330, 3)
    b.image((150, 420, 450, 620))
    b.text(150, 632, "Figure 2: A screenshot of the dashboard.")
    first, second = detect_figures(b.open())
    assert (first.number, first.source) == (1, "vector")
    assert (second.number, second.source) == (2, "raster")
    assert first.bbox_pt[1] < second.bbox_pt[1]
    assert close(second.bbox_pt, (150, 420, 450, 620))


def test_a_fig_dot_caption_below_and_a_table_caption_above_name_their_regions():
    """The caption styles a figure is numbered by, through detection: "Fig. 7." below a picture, and "Table 2:"
    above a table drawn as rules (a table's caption is printed above it)."""
    b = PageBuilder()
    b.body(60, 3)
    b.image((150, 120, 450, 300))
    b.text(150, 312, "Fig. 7. Queue depth over one day.")
    b.body(350, 2)
    b.text(150, 420, "Table 2: Retry limits by service.")
    for k in range(6):  # a ruled table: six rules across, two down
        b.line(150, 440 + 30 * k, 450)
    b.rect((150, 440, 450, 590))
    b.rect((300, 440, 300.5, 590), fill=True)
    figure, table = detect_figures(b.open())
    assert (figure.number, figure.kind, figure.source) == (7, "figure", "raster")
    assert figure.caption.startswith("Fig. 7. Queue depth") and close(figure.bbox_pt, (150, 120, 450, 300))
    assert (table.number, table.kind, table.source) == (2, "table", "vector") and table.ref == ("table", "2")
    assert table.caption.startswith("Table 2: Retry limits") and iou(table.bbox_pt, (150, 440, 450, 590)) > 0.9


def test_a_figure_point_is_found_by_its_caption_and_the_sentences_that_name_it():
    region = FigureRegion(3, "figure", "Figure 3: Revenue by quarter.", (0, 0, 10, 10), "raster")
    page = ("Sales rose. As Figure 3 shows, revenue peaked in Q2. Table 3 lists the regions. "
            "Figures 2-4 share one axis.\nNothing else names it.")
    assert figure_text(region, page) == ("Figure 3: Revenue by quarter. As Figure 3 shows, revenue peaked in Q2. "
                                         "Figures 2-4 share one axis.")
    table = FigureRegion(3, "table", "", (0, 0, 10, 10), "vector")
    assert figure_text(table, page) == "Table 3 lists the regions."
    assert figure_text(FigureRegion(None, "image", "", (0, 0, 10, 10), "raster"), page) == ""


def test_a_reference_names_a_figure_by_kind_and_number_as_printed_or_a_panel_of_it():
    fig3 = FigureRegion(3, "figure", "Figure 3: Latency.", (0, 0, 1, 1), "vector")
    assert fig3.named_by(("figure", "3")) and fig3.named_by(("figure", "3b")) and fig3.named_by(("figure", "3B"))
    assert not any(fig3.named_by(ref) for ref in (("table", "3"), ("figure", "33"), ("figure", "4")))
    roman = FigureRegion(None, "table", "TABLE IV: Costs.", (0, 0, 1, 1), "vector")
    assert roman.named_by(("table", "IV")) and not any(roman.named_by(r) for r in (("table", "V"), ("figure", "IV")))
    dotted = FigureRegion(None, "figure", "Figure 3.2 Cache hits", (0, 0, 1, 1), "vector")
    assert dotted.named_by(("figure", "3.2")) and dotted.named_by(("figure", "3.2a"))
    assert not dotted.named_by(("figure", "3"))
    listing = FigureRegion(2, "figure", "Listing 2: retry loop in the client", (0, 0, 1, 1), "vector")
    assert listing.named_by(("listing", "2")) and not listing.named_by(("listing", "3"))
    picture = FigureRegion(None, "image", "", (0, 0, 1, 1), "raster")
    assert not picture.named_by(("figure", "1"))


def test_bbox_px_at_scale_2_doubles_the_box_and_json_round_trips():
    region = FigureRegion(3, "figure", "Figure 3: x", (10.25, 20.0, 110.5, 220.0), "raster")
    assert region.bbox_px(2) == (20, 40, 221, 440)
    assert region.bbox_px(2, size=(200, 300)) == (20, 40, 200, 300)
    assert FigureRegion.from_json(region.to_json()) == region
    with pytest.raises(ValueError, match="kind"):
        FigureRegion(None, "chart", "", (0, 0, 1, 1), "vector")  # type: ignore[arg-type]


def test_iou_and_the_evaluation_matching_is_greedy_one_to_one_at_half_overlap():
    assert iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(50 / 150)
    assert iou((0, 0, 1, 1), (2, 2, 3, 3)) == 0.0
    truth = [(0, 0, 100, 100), (200, 0, 300, 100)]
    found = [(0, 0, 100, 90), (0, 0, 100, 100), (200, 0, 300, 20), (400, 0, 500, 100)]
    # the exact box wins the first label; the 90 % box is left over; a 20 % sliver matches nothing
    assert match(found, truth) == [(1, 0)]


def _including(figure_pdf: bytes, page_size: tuple[float, float], at: tuple[float, float], scale: float,
               path, chart: tuple[float, float, float, float] | None = None) -> None:
    """A document whose one page has body text (and a ``chart`` of paths drawn on the page itself) and the
    figure's page included as ONE form XObject at ``at`` (top-left, points) and ``scale``: what LaTeX's
    \\includegraphics of a PDF figure writes."""
    host = PageBuilder(*page_size)
    host.body(40, 3)
    if chart is not None:
        host.chart(chart)
    host.form(figure_pdf, at, scale)
    Path(path).write_bytes(host.bytes())


def test_the_tuning_and_held_out_label_sets_are_well_formed_and_share_no_page():
    """mmrag/bench/figures: boxes.jsonl (the pages the rules were tuned on) and heldout.jsonl (pages drawn at random
    from the rest) label pages of the fetched realdocs PDFs only, within each PDF's page count, never the same
    page twice, with ordered boxes of a known kind."""
    from mmrag.bench.figures.evaluate import load_labels
    from mmrag.bench.realdocs.fetch import load_sources

    here = Path(__file__).resolve().parents[1] / "mmrag" / "bench" / "figures"
    pages = {s["doc"]: s["pages"] for s in load_sources()}
    tuned, held = (load_labels(here / name) for name in ("boxes.jsonl", "heldout.jsonl"))
    assert (len(tuned), len(held)) == (47, 64)
    assert not {(r["doc"], r["page"]) for r in tuned} & {(r["doc"], r["page"]) for r in held}
    for row in tuned + held:
        assert row["doc"] in pages and 1 <= row["page"] <= pages[row["doc"]], row
        for f in row["figures"]:
            x0, y0, x1, y1 = f["bbox_pt"]
            assert 0 <= x0 < x1 and 0 <= y0 < y1 and f["kind"] in ("figure", "table", "image"), row
    assert sum(len(r["figures"]) for r in held) == 19 and sum(not r["figures"] for r in held) == 47
    assert len({(r["doc"], r["page"]) for r in held}) == len(held)  # no page drawn twice across the three draws


def test_a_drawing_included_as_a_form_is_one_key_at_any_place_and_size(tmp_path):
    """Issue 26: a form XObject figure is rendered from the form alone, in its own coordinates, so the same
    figure included in two documents at other places and sizes is the same pixels, one key; as a region of its
    page (the way any other drawing is cropped) its pixels depend on the size it is shown at."""
    from mmrag.core.settings import Settings
    from ingestion.figures import _render_alone
    from ingestion.loaders import open_document

    drawing = PageBuilder(320, 210)
    drawing.chart((10, 10, 310, 200))
    figure = drawing.bytes()
    _including(figure, (612, 792), (120, 260), 1.0, tmp_path / "report.pdf")
    _including(figure, (792, 612), (333.3, 141.7), 0.7, tmp_path / "slides.pdf")
    settings = Settings(pdf_dpi=96, max_pdf_pages=500, max_image_pixels=50_000_000, ocr=False, ocr_lang="eng",
                        figures=True)
    crops = []
    for name in ("report.pdf", "slides.pdf"):
        with open_document(tmp_path / name, settings.documents) as doc:
            (page,) = list(doc.pages())
            (crop,) = page.figures
        crops.append(crop)
    assert [c.region.source for c in crops] == ["form", "form"]
    assert close(crops[0].region.bbox_pt, (120 + 10, 260 + 10, 120 + 310, 260 + 200), tol=3)
    assert crops[0].content_hash == crops[1].content_hash  # one key
    # The drawing's 300 x 190 pt (and its strokes' width) at 144 dpi, whatever size it was shown at.
    assert crops[0].image.size == crops[1].image.size and close(crops[0].image.size, (600, 380), tol=8)
    import pypdfium2 as pdfium

    as_regions = [_render_alone(pdfium.PdfDocument(str(tmp_path / n))[0], c.region.bbox_pt)
                  for n, c in zip(("report.pdf", "slides.pdf"), crops)]
    assert as_regions[0].size != as_regions[1].size  # the way a drawing on the page is cropped: two keys


def test_the_key_measurement_detects_and_crops_each_drawn_figure_again_where_it_was_moved(tmp_path):
    """mmrag/bench/figures/evaluate.py --keys: the page's content moved and scaled onto a new page, detected and cropped
    as ingestion does; a form keeps its key at every placement."""
    import json

    from mmrag.bench.figures.evaluate import PLACEMENTS, crop_key_stability

    drawing = PageBuilder(320, 210)
    drawing.chart((10, 10, 310, 200))
    _including(drawing.bytes(), (612, 792), (120, 420), 1.0, tmp_path / "both.pdf", chart=(100, 110, 500, 330))
    labels = tmp_path / "labels.jsonl"
    labels.write_text(json.dumps({"doc": "both.pdf", "page": 1, "figures": []}) + "\n")
    keys = crop_key_stability(tmp_path, labels)
    moved = sum(s == 1 and (dx, dy) != (0, 0) for dx, dy, s in PLACEMENTS)
    assert keys["form"] == {"same": len(PLACEMENTS), "of": len(PLACEMENTS), "share": 1.0}
    assert keys["form, rewritten"]["of"] == 1  # the harness's floor: the content rewritten, nothing moved
    assert keys["form, moved"]["of"] == moved and keys["form, scaled"]["of"] == len(PLACEMENTS) - moved - 1
    assert keys["vector"]["of"] == len(PLACEMENTS) and keys["all"]["of"] == 2 * len(PLACEMENTS)
    assert keys["vector, rewritten"]["same"] == 1 and keys["vector, moved"]["same"] == moved  # alone, moved
    assert keys["vector, scaled"]["same"] == 0  # a drawing on the page itself, shown smaller: other pixels


def test_a_page_over_the_object_bound_raises_before_walking_them():
    """Issue 41, item 2: a page of a huge content stream (200,000 tiny paths: 7 s a page) is refused by the figure
    step from its object count alone; one within the bound is walked as ever."""
    b = PageBuilder()
    for k in range(1500):
        x, y = 102 + (k * 97) % 396, 102 + (k * 61) % 296
        b.rect((x, y, x + 1.5, y + 1.5), fill=True)
    page = b.open()
    with pytest.raises(FigureBudgetError, match="1500 drawing objects, over 1000"):
        detect_figures(page, max_objects=1000)
    assert len(detect_figures(page, max_objects=2000)) == 1
    with pytest.raises(FigureBudgetError, match="took over"):  # the time budget, checked as the walk goes
        detect_figures(page, budget_s=1e-9)


def test_thousands_of_large_overlapping_shapes_are_stopped_by_the_time_budget_while_grouped():
    """Issue 41, item 2: a page of 3,000 large overlapping shapes is under the object bound and quick to walk,
    but each shape meets every other in each column it spans (hundreds of millions of comparisons, minutes): the
    grouping checks the page's deadline at each shape and gives up with the figure step's budget error."""
    b = PageBuilder()
    for k in range(3000):
        x, y = 40 + k % 37, 40 + k % 53
        b.rect((x, y, x + 480, y + 640), fill=True)
    with pytest.raises(FigureBudgetError, match="took over"):
        detect_figures(b.open(), budget_s=1.0)
    boxes = [(float(k), 0.0, k + 300.0, 300.0) for k in range(100)]
    with pytest.raises(FigureBudgetError, match="grouping its 100 drawn shapes took over"):
        _cluster(boxes, 6.0, deadline=0.0)
    assert _cluster(boxes, 6.0, deadline=None) == [(0.0, 0.0, 399.0, 300.0)]  # no deadline: grouped as ever



# --- what a figure point is found by: its caption, the words drawn in it, the sentences naming it anywhere ------


def test_a_figures_words_keep_its_labels_without_its_caption_or_tick_values():
    drawn = "0 10 20 30\nLatency (ms)  p50 p99\n2.5 5.0 Figure 4: Tail latency by load. Requests/s"
    assert figure_words(drawn, "Figure 4: Tail latency by load.") == "Latency (ms) p50 p99 Requests/s"
    assert figure_words("1 2 3 4 5") == ""
    long = figure_words(" ".join(f"label{k}" for k in range(200)))
    assert len(long) <= FIGURE_WORDS_CHARS and long.endswith(tuple("0123456789")) and "label1 " in long


def test_a_figure_point_adds_the_words_drawn_in_it_and_the_sentences_naming_it_on_other_pages():
    region = FigureRegion(2, "figure", "Figure 2: Decay.", (0, 0, 10, 10), "vector")
    pages = [(1, "Figure 2: Decay. The apparatus is shown."),
             (3, "As Figure 2 shows, radon halves every 3.8 days. Table 2 lists isotopes."),
             (5, "Compare with Figure 2 for thorium. Nothing else.")]
    mentions = figure_mentions(pages)
    assert mentions[("figure", "2")] == [(1, "Figure 2: Decay."),
                                         (3, "As Figure 2 shows, radon halves every 3.8 days."),
                                         (5, "Compare with Figure 2 for thorium.")]
    assert mentions[("table", "2")] == [(3, "Table 2 lists isotopes.")]
    elsewhere = [s for page, s in mentions[region.ref] if page != 1]
    text = figure_text(region, pages[0][1], words="half-life activity Bq", elsewhere=elsewhere)
    assert text == ("Figure 2: Decay. half-life activity Bq As Figure 2 shows, radon halves every 3.8 days. "
                    "Compare with Figure 2 for thorium.")
    # each sentence once, however many pages repeat it; the whole cut where MiniLM stops reading
    assert figure_text(region, "See Figure 2 here.", elsewhere=["See Figure 2 here."] * 3) == \
        "Figure 2: Decay. See Figure 2 here."
    assert len(figure_text(region, "", elsewhere=[f"Figure 2 case {k}." for k in range(400)])) == FIGURE_TEXT_CHARS
    # an unnumbered figure is named by no sentence: its caption and its own words find it
    plain = FigureRegion(None, "image", "", (0, 0, 10, 10), "raster")
    assert figure_text(plain, "As Figure 2 shows.", words="throughput", elsewhere=elsewhere) == "throughput"


def _crops(pdf: bytes, tmp_path: Path, **config) -> list:
    path = tmp_path / "doc.pdf"
    path.write_bytes(pdf)
    with open_document(path, DocumentSettings(**{"figures": True, "ocr": False, **config})) as doc:
        return [crop for page in doc.pages() for crop in page.figures]


def test_a_drawn_charts_labels_legend_and_axis_title_are_its_words(tmp_path):
    b = PageBuilder()
    b.body(72, 3)
    b.chart((120, 150, 480, 400))
    b.text(130, 160, "cache hits")  # a legend entry inside the frame
    b.text(300, 380, "Requests per second")  # the axis title along its foot
    for k, tick in enumerate(("0", "50", "100")):
        b.text(100, 390 - 100 * k, tick, size=8)
    b.text(120, 425, "Figure 5: Throughput under load.")
    b.body(460, 4)
    (crop,) = _crops(b.bytes(), tmp_path)
    assert crop.region.number == 5
    assert "cache hits" in crop.words and "Requests per second" in crop.words
    assert "Throughput under load" not in crop.words and "body text" not in crop.words  # not its caption, nor the page
    assert not any(w.isdigit() for w in crop.words.split())


def _picture_with_text(text: str) -> bytes:
    im = Image.new("RGB", (640, 360), "white")
    draw = ImageDraw.Draw(im)
    draw.rectangle((40, 120, 600, 320), outline="black", width=3)
    draw.text((60, 30), text, fill="black", font=ImageFont.load_default(size=44))
    out = io.BytesIO()
    im.save(out, "JPEG", quality=95)
    return out.getvalue()


@pytest.mark.skipif(not ocr_available(), reason="tesseract is not installed (apt-get install tesseract-ocr)")
def test_a_raster_figure_without_text_objects_is_read_by_ocr_where_ocr_is_on(tmp_path):
    b = PageBuilder()
    b.body(72, 3)
    b.image((120, 150, 480, 352.5), _picture_with_text("REACTOR COOLANT FLOW"))
    b.text(120, 365, "Figure 1: The loop.")
    b.body(420, 4)
    (read,) = _crops(b.bytes(), tmp_path, ocr=True)
    assert read.region.source == "raster" and {"REACTOR", "COOLANT", "FLOW"} <= set(read.words.split())
    (unread,) = _crops(b.bytes(), tmp_path, ocr=False)  # MMRAG_OCR=false: no tesseract run, no words
    assert unread.words == ""


def test_a_missed_question_is_reported_with_its_pages_ranks_and_what_was_cited_instead():
    from retrieval.evaluate import LabelledQuestion, misses
    from retrieval.search import Hit

    def hit(doc: str, page: int) -> Hit:
        return Hit(f"{doc}-{page}", doc, doc, page, 1.0, "", None, 0, doc)  # type: ignore[arg-type]

    labelled = [LabelledQuestion("found?", frozenset({("a.pdf", 2)}), id="q1"),
                LabelledQuestion("missed?", frozenset({("a.pdf", 9)}), kind="figure", id="q2"),
                LabelledQuestion("both?", frozenset({("a.pdf", 2), ("a.pdf", 7)}), needs_all=True, id="q3")]
    ranking = [hit("a.pdf", 2), hit("a.pdf", 3), hit("a.pdf", 7), hit("a.pdf", 9)]
    cited = [[("a.pdf", 2)], [("a.pdf", 3), ("a.pdf", 2)], [("a.pdf", 2), ("a.pdf", 3)]]
    assert misses(cited, [ranking] * 3, labelled) == [
        {"id": "q2", "kind": "figure", "needs": "any", "question": "missed?", "hybrid_rank": {"a.pdf p9": 4},
         "cited": ["a.pdf p3", "a.pdf p2"]},
        {"id": "q3", "kind": "text", "needs": "all", "question": "both?", "hybrid_rank": {"a.pdf p2": 1, "a.pdf p7": 3},
         "cited": ["a.pdf p2", "a.pdf p3"]}]
    assert misses([[("b.pdf", 1)]], [[]], labelled[:1])[0]["hybrid_rank"] == {"a.pdf p2": None}
    # with the index's payloads: what each needed page holds, its figures and the start of its text
    from mmrag.core.figures import PageFigure
    from mmrag.core.keys import ImageKey
    from mmrag.core.pages import TextSource
    from mmrag.core.payload import PagePayload

    key = ImageKey.parse(f"img1-{'0' * 64}-deadbeef-px3136-200704")
    figure = PageFigure(FigureRegion(6, "figure", "Figure 6: Node shapes.", (0, 0, 9, 9), "form"), key, 4)
    page = PagePayload(doc_id="d", doc="a.pdf", path="/x/a.pdf", page=9, num_pages=9, file_sha256="", content_hash="",
                       image_key=key, image_tokens=4, width=9, height=9, text="  The   shapes " + "x" * 400,
                       text_source=TextSource.TEXT_LAYER, fingerprint="", figures=(figure,))
    (described,) = misses(cited[1:2], [ranking], labelled[1:2], {("a.pdf", 9): page})
    assert described["needed"] == {"a.pdf p9": {"figures": ["figure 6: Figure 6: Node shapes."],
                                                "text": ("The shapes " + "x" * 400)[:200]}}
    assert misses(cited[1:2], [ranking], labelled[1:2], {})[0]["needed"] == {"a.pdf p9": {"indexed": False}}
