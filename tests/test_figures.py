"""Figure regions found from a PDF page's own structure (ingestion.figures) and the FigureRegion contract.

The PDFs are built here with pdfium itself: image objects, path objects and standard-font text objects
placed at known positions, saved and opened again, as an ingested PDF would be.
"""

from __future__ import annotations

import pytest

from bench.figures.evaluate import match
from core.figures import FigureRegion, iou
from devkit.pdfbuild import PageBuilder
from ingestion.figures import detect_figures


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
