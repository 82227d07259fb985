"""`mmrag bench --fairness` (mmrag/bench/fairness.py, issue 41): the inputs it makes are what the issue measured (a PDF
of many pages sharing one content stream of tiny paths, pages slow to rasterise, images past the processor's
aspect ratio and tiny files declaring huge sizes), its summaries and targets, and its flags. The run itself
starts a replica and `mmrag serve` for minutes: docs/benchmarks.md records it; the behaviours it measures are tested
on real processes in tests/test_tenant_quotas.py, tests/test_ingest_fairness.py and tests/test_figures.py."""

from __future__ import annotations

import io
import os

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c
import pytest
from PIL import Image
from typer.testing import CliRunner

from mmrag.bench.fairness import (MEMORY_BOUND_MIB, Asked, bad_inputs, fairness_table, memory_mib, pathological_pdf,
                            reset_peak, slow_render_pdf, summarize_asks)
from ingestion.figures import FigureBudgetError, detect_figures


def test_the_pathological_pdf_shares_one_stream_of_tiny_paths_that_the_figure_step_refuses_by_count():
    body = pathological_pdf(pages=30, paths=25_000)
    doc = pdfium.PdfDocument(body)
    assert len(doc) == 30
    assert body.count(b"/Contents 3 0 R") == 30 and body.count(b"endstream") == 1  # one stream, every page
    page = doc[29]
    assert pdfium_c.FPDFPage_CountObjects(page.raw) == 25_000
    with pytest.raises(FigureBudgetError, match="25000 drawing objects, over 20000"):
        detect_figures(page)


def test_slow_pages_have_a_stream_each_and_the_bad_inputs_declare_what_the_issue_sent():
    doc = pdfium.PdfDocument(slow_render_pdf(pages=2, paths=50))
    assert len(doc) == 2 and pdfium_c.FPDFPage_CountObjects(doc[1].raw) == 50
    inputs = bad_inputs(tiff_frames=3)
    sizes = {}
    for kind, (name, body) in inputs.items():
        with Image.open(io.BytesIO(body)) as im:
            sizes[kind] = (im.size, getattr(im, "n_frames", 1))
        assert len(body) < 40_000, kind  # tiny files ...
    assert sizes == {"aspect 1x10000 png": ((1, 10000), 1), "aspect 20000x2 png": ((20000, 2), 1),  # ... past 200:1
                     "tiff 7000x7000 1-bit": ((7000, 7000), 1), "tiff 3 frames 7000x7000 1-bit": ((7000, 7000), 3),
                     "webp 16383x3000": ((16383, 3000), 1)}  # ... or declaring 49M pixels


def test_the_peak_is_read_and_reset_from_proc():
    before = memory_mib(os.getpid())
    assert before["VmHWM"] >= before["VmRSS"] > 0
    if reset_peak(os.getpid()):
        after = memory_mib(os.getpid())
        assert after["VmHWM"] <= before["VmHWM"] and after["VmHWM"] >= after["VmRSS"] * 0.99


def test_asks_are_summarised_and_each_target_is_marked_against_its_measure():
    asked = [Asked(200, 1.0, 0.0, stages={"admission_s": 0.0, "retrieve_s": 0.1}), Asked(200, 3.0, 0.2),
             Asked(429, 0.01, error="overloaded"), Asked(500, 0.5, error="boom")]
    summary = summarize_asks(asked)
    assert summary | {"first_errors": None, "stages_p50_s": None} == {
        "asked": 4, "answered": 2, "refused": 1, "errors": 1, "latency_p50_s": 3.0, "latency_max_s": 3.0,
        "admission_wait_p50_s": 0.2, "admission_wait_p99_s": 0.2, "first_errors": None, "stages_p50_s": None}
    assert summary["first_errors"] == ["overloaded", "boom"]
    assert summary["stages_p50_s"] == {"admission_s": 0.0, "retrieve_s": 0.1}
    result = {"questions": {"a_alone": {"latency_p50_s": 1.0}, "a_latency_ratio": 3.0,
                            "a_beside_b": summary, "b": {"answered": 9, "refused": 1, "seconds": 45, "loops": 200}},
              "ingest": {"a_upload_indexed_s": 12.0, "b_cancelled_in_s": 1.0},
              "renders": {"a_beside_b_max_s": 0.3, "a_alone_p50_s": 0.02, "b_render_p50_s": 5.0},
              "memory": {"idle_mib": 900, "worst_over_idle_mib": MEMORY_BOUND_MIB + 1},
              "met": {"a_latency_ratio": True, "a_admission_wait_p99_s": False, "a_refused": False,
                      "a_upload_indexed_s": False, "a_render_s": True, "memory_over_idle_mib": False}}
    table = fairness_table(result)
    assert "| A's latency p50 beside B / alone | 3.0 / 1.0 s = 3.0x | <= 3.0x | met |" in table
    assert "| A's one-page upload indexed beside B's PDF | 12.0 s | <= 10.0 s | MISSED |" in table
    assert f"{MEMORY_BOUND_MIB + 1} MiB (idle 900 MiB)" in table and table.count("MISSED") == 4


def test_fairness_is_a_benchmark_of_its_own():
    from mmrag.cli import app

    done = CliRunner().invoke(app, ["bench", "--fairness", "--e2e"])
    assert done.exit_code == 2 and "--fairness is a benchmark of its own" in done.output
