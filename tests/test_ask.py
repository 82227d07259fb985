"""`mmrag ask --pages`: an answer over given pages in the documented JSON shape, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmrag.ask_cmd import lookup_pages, open_page_index, parse_page_refs
from rag.answer import answer_over_pages

REPO = Path(__file__).resolve().parents[1]
USAGE_KEYS = {"prompt_tokens", "cached_tokens", "image_tokens", "cached_image_tokens", "vision_encodes"}


def test_page_refs_parse_and_reject_malformed_specs():
    assert parse_page_refs("report.pdf:2, my:file.png:1") == [("report.pdf", 2), ("my:file.png", 1)]
    for bad in ["", "report.pdf", "report.pdf:0", ":3", "a.pdf:x"]:
        with pytest.raises(ValueError, match="DOC:PAGE"):
            parse_page_refs(bad)


async def test_an_answer_over_pages_has_the_documented_shape_and_names_the_test_model(
    inprocess_engine, engine_settings
):
    index = open_page_index(engine_settings)
    try:
        pages = lookup_pages(index, [("operations_manual.pdf", 1), ("q3_quarterly_report.pdf", 2)])
    finally:
        index.client.close()
    first = (await answer_over_pages(inprocess_engine, "What does the diagram show?", pages, max_tokens=8)).to_json()
    again = (await answer_over_pages(inprocess_engine, "Which services are shown?", pages, max_tokens=8)).to_json()
    assert {"answer", "sub_questions", "citations", "usage", "model"} <= first.keys()
    assert USAGE_KEYS <= first["usage"].keys()
    assert first["citations"][0] == {"page_id": pages[0].page_id, "doc": "operations_manual.pdf", "page": 1,
                                     "score": 1.0, "figure": None}  # pages chosen by hand: no hit on a figure
    assert first["model"]["random_weights"] is True and "not meaningful" in first["model"]["note"]
    assert first["usage"]["vision_encodes"] == 0
    assert first["usage"]["image_tokens"] == sum(p.image_tokens for p in pages)
    # Same pages, another question: the two-image prefix is served from the cache.
    assert again["usage"]["cached_image_tokens"] > 0


def run_cli(*args: str, settings) -> subprocess.CompletedProcess:
    env = dict(os.environ, MMRAG_DATA_DIR=str(settings.storage.data_dir), MMRAG_MODEL=settings.model.name,
               HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "mmrag", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize(
    "args, message",
    [
        (["ask", "   ", "--pages", "operations_manual.pdf:1"], "question is empty"),
        (["ask", "q", "--pages", "operations_manual.pdf"], "DOC:PAGE"),
        (["ask", "q", "--pages", "no_such_doc.pdf:1"], "not in the index"),
        (["warm", "--top", "2"], "MMRAG_ENGINE_URLS"),
    ],
)
def test_cli_errors_name_the_fix_without_a_traceback(args, message, engine_settings, ingested):
    result = run_cli(*args, settings=engine_settings)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.engine
def test_cli_ask_prints_one_json_object(engine_settings, ingested):
    result = run_cli("ask", "What is on this page?", "--pages", "operations_manual.pdf:1", "--max-tokens", "4",
                     "--json", settings=engine_settings)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert [{k: c[k] for k in ("doc", "page", "score")} for c in out["citations"]] == [
        {"doc": "operations_manual.pdf", "page": 1, "score": 1.0}]
    assert out["citations"][0]["page_id"]  # what GET /v1/pages/{id} takes
    assert out["usage"]["completion_tokens"] == 4 and USAGE_KEYS <= out["usage"].keys()
