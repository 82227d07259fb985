"""`mmrag bench --image-input`: the two deployment forms (MMRAG_IMAGE_INPUT) measured on one workload; smoke size on
the tiny model, whose timings mean nothing: what is checked is the structure and what must hold in any run.

One real run, in process, as the command runs it (mmrag/bench_cmd._bench_image_input) with ``remote=False`` and on
the session's engine (vLLM allows one in-process engine per process): the corpus ingested three ways, then both
forms on the in-process engine. The `vllm serve` half (the bench starts its own replica: ~50 s on 2 cores for the
tiny model alone) is left out; the command always runs it, and tests/test_image_input.py checks both forms over a
replica. The session's tiny model is the bench's --tiny model, linked where the bench looks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from pathlib import Path

import pytest

from mmrag.bench.model import TINY_SPEC
from mmrag.core.keys import ResolutionPolicy
from tests.test_bench_figures import _own_settings

PAGES, QUESTIONS, LENGTH = 4, 3, 4
CONCURRENCY, ZIPF, SEED = 2, 1.0, 0


@pytest.fixture(scope="module")
async def image_input_run(inprocess_engine, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What `mmrag bench --image-input --tiny` (pages=4, questions=3, concurrency=2, max_tokens=4, no replica)
    writes to its JSON file and prints: the command's own steps (mmrag/bench_cmd.py), its run on the session's
    engine (the command's engine config over the session engine's, and the session's standard bounds)."""
    from mmrag.bench.image_input import engine_config_for, image_input_table, run_image_input
    from mmrag.bench_cmd import _image_input_inputs, _report, _started

    data = tmp_path_factory.mktemp("bench-image-input")
    (data / "models").mkdir()
    (data / "models" / TINY_SPEC.folder_name).symlink_to(tiny_model)
    started = _started()
    inputs, spec = _image_input_inputs(_own_settings(data_dir=data), tiny=True, depth=None, pages=PAGES,
                                       questions=QUESTIONS, concurrency=CONCURRENCY, max_tokens=LENGTH, zipf=ZIPF,
                                       seed=SEED, remote=False)
    # The session engine's vLLM resizes pixels to the session's standard bounds (set at its start, which the
    # engine config cannot change), so the bench's pages are keyed and encoded under those bounds.
    policy = ResolutionPolicy(*inprocess_engine.config.image_pixels)
    result = await run_image_input(dataclasses.replace(
        inputs, policy=policy, engine=inprocess_engine, engine_config=engine_config_for(inprocess_engine.config,
                                                                                        policy)))
    out = data / "image-input.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        _report("image_input", result, spec, inputs.model, started, out, image_input_table)
    return {"data": json.loads(out.read_text()), "stdout": printed.getvalue()}


def test_both_forms_serve_the_same_plans_with_the_same_greedy_tokens(image_input_run):
    r = image_input_run["data"]["image_input"]
    serving = r["serving"]
    assert list(serving) == ["inprocess_embeds", "inprocess_pixels"]
    for name, c in serving.items():
        assert c["forms_reported"] == [c["form"]] and name.endswith(c["form"])  # every completion says its form
        assert c["questions"] == c["plans"] == QUESTIONS  # one prompt per question
        assert c["completion_tokens_per_plan"] == LENGTH  # fixed length: both forms decode the same amount
        assert c["questions_per_s"] > 0 and 0 < c["ttft_p50_s"] <= c["ttft_p95_s"]
        assert 0 <= c["cached_image_tokens"] <= c["image_tokens"] and 0 <= c["image_hit_rate"] <= 1
    embeds, pixels = serving["inprocess_embeds"], serving["inprocess_pixels"]
    assert embeds["images_sent"] == pixels["images_sent"] > 0 and embeds["image_tokens"] == pixels["image_tokens"]
    check = r["same_tokens_check"]
    assert check["plans"] == QUESTIONS and check["tokens_per_plan"] == LENGTH
    if r["machine"]["dtype"] == "float32":  # in bf16 the two encoders round differently (serving/engine/images.py)
        assert r["same_tokens"] is True and check["equal_by_engine"] == {"inprocess": True}
        assert check["first_difference"] == {"inprocess": [None] * QUESTIONS}
    assert set(r["ratios_pixels_over_embeds"]) == {"inprocess"}


def test_vision_forwards_and_bytes_per_page_are_the_forms_own(image_input_run):
    data = image_input_run["data"]
    r, model = data["image_input"], data["model"]
    embeds, pixels = r["serving"]["inprocess_embeds"], r["serving"]["inprocess_pixels"]
    # Embeds: the tower ran at ingest, once per page, never at serving.
    assert embeds["vision_forwards"] == 0 and r["ingest"]["ingest_forwards_per_page"] == 1.0
    # Pixels: from cold caches, at least each question's first prompt encodes its images in vLLM.
    assert 0 < pixels["vision_forwards"] <= pixels["images_sent"]
    assert pixels["vision_forwards_per_question"] == round(pixels["vision_forwards"] / QUESTIONS, 3)
    (tokens_per_page,) = r["ingest"]["image_tokens_per_page"]
    assert embeds["bytes_per_page"] == tokens_per_page * model["hidden"] * 4  # fp32 image tokens
    assert 0 < pixels["bytes_per_page"] < pixels["decoded_rgb_bytes_per_page"] == 448 * 448 * 3  # PNG < RGB
    assert r["ratios_pixels_over_embeds"]["inprocess"]["bytes_per_page"] == round(
        pixels["bytes_per_page"] / embeds["bytes_per_page"], 4)


def test_ingest_without_tokens_runs_no_tower_forward_and_stores_only_the_png(image_input_run):
    ing = image_input_run["data"]["image_input"]["ingest"]
    assert ing["pages"] == PAGES
    assert ing["tokens"]["tower_forwards"] == ing["tokens_and_pixels"]["tower_forwards"] == PAGES
    assert ing["pixels_only"]["tower_forwards"] == 0
    assert ing["tokens"]["png_bytes_per_page"] == 0
    assert ing["pixels_only"]["png_bytes_per_page"] == ing["tokens_and_pixels"]["png_bytes_per_page"] > 0
    sizes = [ing[k]["stored_bytes_per_page"] for k in ("pixels_only", "tokens", "tokens_and_pixels")]
    assert sizes == sorted(sizes) and sizes[0] < sizes[1]
    assert all(ing[k]["s_per_page"] > 0 for k in ("tokens", "tokens_and_pixels", "pixels_only"))
    assert ing["ingest_time_saved"] == round(1 - ing["pixels_only"]["s_per_page"] / ing["tokens"]["s_per_page"], 4)


def test_the_table_and_the_machine_are_reported(image_input_run):
    r, out = image_input_run["data"]["image_input"], image_input_run["stdout"]
    assert r["machine"]["cpu"] and r["machine"]["cpus"] >= 1 and r["machine"]["dtype"] in out
    for name in r["serving"]:
        assert f"| {name} |" in out
    assert "| pixels_only |" in out and "ingest_time_saved" in out
    assert f"same_tokens: {str(r['same_tokens']).lower()}" in out


@pytest.mark.slow
def test_image_input_refuses_the_other_modes_options(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from mmrag.cli import app

    # Only this run's settings (a session's MMRAG_REDIS_URL must not take its store); an emulated ISA stays.
    for k in [k for k in os.environ if k.startswith("MMRAG_") and k != "MMRAG_EMULATE_ISA"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MMRAG_DATA_DIR", str(tmp_path))
    done = CliRunner().invoke(app, ["bench", "--image-input", "--e2e", "--rate", "2", "--tiny"])
    assert done.exit_code != 0 and "--image-input" in done.stderr and "--e2e" in done.stderr
