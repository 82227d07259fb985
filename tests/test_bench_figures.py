"""`mmrag bench --figures --tiny`: page-level against figure-level keys on one engine (issue 26); timings mean nothing.

One real run, in process, as `mmrag bench --figures --tiny` runs it (mmrag/bench_cmd._bench_figures) but on the
session's engine (vLLM allows one in-process engine per process; the bench serves both levels on one engine
anyway): the figure corpus built with pdfium, ingested by the real Ingestor with figures on, each question answered
joint (one prompt) and split (a prompt per image) at both levels through the scheduler. The session's tiny model
is the bench's --tiny model, linked where the bench looks for it, so it is not built again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from pathlib import Path

import pytest

from mmrag.bench.figure_keys import (CONFIGS, FIGURE_LEVEL, PAGE_LEVEL, ROUNDS, SPLIT, FigureCorpusSpec,
                               build_figure_corpus, figures_table, make_questions, run_figure_bench)
from mmrag.bench.model import TINY_SPEC
from mmrag.bench_cmd import _figures_inputs, _report, _started

CHARTS, QUESTIONS, LENGTH = 4, 8, 4
CONCURRENCY, ZIPF, SEED = 4, 1.0, 0  # the command's defaults
PLACEMENTS = ("2", "3")  # the sweep's points: pages each chart is asked through
FIELDS = ("questions", "prompts", "questions_per_s", "ttft_p50_s", "image_hit_rate", "position_oracle_hit_rate",
          "image_tokens", "cached_image_tokens", "image_tokens_per_prompt", "distinct_image_keys",
          "vision_forwards_at_ingest", "wall_s")


def _own_settings(**values):
    """Settings from only these values (a session's MMRAG_* variables, its Redis or Qdrant URL say, must not
    reach the bench's ingest), as the command's own process sees them; an emulated ISA stays."""
    from mmrag.core.settings import Settings

    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith("MMRAG_") and k != "MMRAG_EMULATE_ISA"]:
            mp.delenv(k)
        return Settings(**values)


@pytest.fixture(scope="module")
async def figures_run(inprocess_engine, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What `mmrag bench --figures --tiny --charts 4 --questions 8 --max-tokens 4 --placements 2,3 --json F`
    writes to F (its "figures" section) and prints: the command's own steps (mmrag/bench_cmd.py), its run on the
    session's engine instead of one of its own."""
    data = tmp_path_factory.mktemp("bench-figures")
    (data / "models").mkdir()
    (data / "models" / TINY_SPEC.folder_name).symlink_to(tiny_model)
    started = _started()
    inputs, spec = _figures_inputs(_own_settings(data_dir=data), tiny=True, depth=None, charts=CHARTS,
                                   questions=QUESTIONS, concurrency=CONCURRENCY, max_tokens=LENGTH, zipf=ZIPF,
                                   seed=SEED, placements=tuple(int(k) for k in PLACEMENTS))
    result = await run_figure_bench(dataclasses.replace(inputs, engine=inprocess_engine,
                                                        engine_config=inprocess_engine.config))
    out = data / "figures.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        _report("figures", result, spec, inputs.model, started, out, figures_table)
    return {"data": json.loads(out.read_text())["figures"], "stdout": printed.getvalue()}


def levels(run: dict, placements: str = PLACEMENTS[0]) -> dict[str, dict]:
    return run["data"]["by_placements"][placements]["by_length"][str(LENGTH)]


def test_both_levels_run_on_one_engine_and_report_every_figure_and_each_check(figures_run):
    data = figures_run["data"]
    assert list(data["by_placements"]) == list(PLACEMENTS)
    for k in PLACEMENTS:
        assert list(data["by_placements"][k]["by_length"]) == [str(LENGTH)]  # --max-tokens: that length only
        assert list(levels(figures_run, k)) == [PAGE_LEVEL, FIGURE_LEVEL, PAGE_LEVEL + SPLIT,
                                                FIGURE_LEVEL + SPLIT]
        for name, r in levels(figures_run, k).items():
            missing = [f for f in FIELDS if f not in r]
            assert not missing, f"{name} lacks {missing}"
            if name.endswith(SPLIT):  # a prompt per image: as many as the images the joint prompt shows
                assert r["questions"] == QUESTIONS and r["images_per_prompt"] == 1.0
                one = levels(figures_run, k)[CONFIGS[name][0]]
                assert r["prompts"] == round(one["images_per_prompt"] * QUESTIONS)
            else:
                assert r["questions"] == r["prompts"] == QUESTIONS  # joint: one prompt per question
            assert r["questions_per_s"] > 0 and r["ttft_p50_s"] > 0 and 0 < r["position_oracle_hit_rate"] <= 1
    assert data["machine"]["cpu"] and data["machine"]["dtype"] == data["engine"]["dtype"]
    assert [t["met"] in (True, False) for t in data["targets"]] == [True] * 5 * len(PLACEMENTS)
    for t in data["targets"]:
        assert f"{t['name']}: {t['measured']} (wanted {t['wanted']}): {'met' if t['met'] else 'MISSED'}" \
            in figures_run["stdout"]
    assert "| page_level |" in figures_run["stdout"] and data["machine"]["dtype"] in figures_run["stdout"]


def test_figure_level_shows_fewer_distinct_images_and_fewer_image_tokens_per_prompt(figures_run):
    page, figure = levels(figures_run)[PAGE_LEVEL], levels(figures_run)[FIGURE_LEVEL]
    assert figure["distinct_image_keys"] < page["distinct_image_keys"]
    assert figure["image_tokens_per_prompt"] < page["image_tokens_per_prompt"]
    # A figure-level prompt shows the chart crops; the ingest's crops have fewer tokens than any page.
    ing = figures_run["data"]["ingest"]
    assert max(ing["image_tokens_per_figure"]) < min(ing["image_tokens_per_page"])


def test_one_chart_pasted_into_different_layouts_is_one_figure_key_and_one_forward(figures_run):
    ing = figures_run["data"]["ingest"]
    layouts = figures_run["data"]["corpus"]["layouts"]
    assert ing["chart_occurrences"] == ing["pages"] == sum(layouts.values()) == int(max(PLACEMENTS)) * CHARTS
    assert ing["distinct_chart_keys"] == CHARTS < ing["chart_occurrences"]
    assert ing["distinct_page_keys"] == ing["pages"]  # every page differs around its chart
    report = ing["report"]
    assert (report["figures"], report["figures_encoded"]) == (ing["figure_occurrences"], ing["distinct_figure_keys"])
    assert ing["vision_forwards"] == {PAGE_LEVEL: report["encoded"],
                                      FIGURE_LEVEL: report["encoded"] + report["figures_encoded"]}
    for name, r in levels(figures_run).items():
        assert r["vision_forwards_at_ingest"] == ing["vision_forwards"][CONFIGS[name][0]]
        assert r["vision_forwards_at_serve"] == 0  # every image came from the feature store


@pytest.mark.parametrize("k", PLACEMENTS)
def test_the_rates_are_the_runs_own_counts(figures_run, k):
    """Each rate is the quotient of the counts the engine reported for this run, not a constant."""
    page, figure = levels(figures_run, k)[PAGE_LEVEL], levels(figures_run, k)[FIGURE_LEVEL]
    for r in (page, figure):
        assert 0 < r["cached_image_tokens"] <= r["image_tokens"]
        assert r["image_hit_rate"] == round(r["cached_image_tokens"] / r["image_tokens"], 4)
        assert r["image_tokens_per_prompt"] == round(r["image_tokens"] / r["prompts"], 2)
        # wall_s is rounded to 10 ms
        assert r["questions_per_s"] == pytest.approx(r["questions"] / r["wall_s"], rel=0.05)
    assert page["image_hit_rate"] != figure["image_hit_rate"]
    split = levels(figures_run, k)[FIGURE_LEVEL + SPLIT]
    page_split = levels(figures_run, k)[PAGE_LEVEL + SPLIT]
    point = [t for t in figures_run["data"]["targets"] if t["name"].endswith(f", {k} pages a chart")]
    oracle, joint_oracle, over_page, over_page_split, tokens = (t["measured"] for t in point)
    assert oracle == round(split["image_hit_rate"] / split["position_oracle_hit_rate"], 3)
    assert joint_oracle == round(figure["image_hit_rate"] / figure["position_oracle_hit_rate"], 3)
    assert over_page == round(split["image_hit_rate"] / page["image_hit_rate"], 3)
    assert over_page_split == round(split["image_hit_rate"] / page_split["image_hit_rate"], 3)
    assert tokens == round(figure["image_tokens_per_prompt"] / page["image_tokens_per_prompt"], 3)


def test_the_sweep_asks_the_same_charts_through_more_pages(figures_run):
    """Every point asks the same charts in the same order, so figure-level's position oracle is one number; what
    changes is the pages page-level keys are reached through, and so its oracle."""
    points = figures_run["data"]["by_placements"]
    asked = [points[k]["pages_asked"] for k in PLACEMENTS]
    assert len({(a["asks"], a["distinct_charts"]) for a in asked}) == 1
    for a in asked:
        assert a["distinct_charts"] <= a["distinct_pages"] <= a["asks"]
    oracles = {levels(figures_run, k)[FIGURE_LEVEL + SPLIT]["position_oracle_hit_rate"] for k in PLACEMENTS}
    assert len(oracles) == 1
    for k, a in zip(PLACEMENTS, asked):  # per image every use after an image's first hits, all its tokens
        page = levels(figures_run, k)[PAGE_LEVEL + SPLIT]
        assert page["position_oracle_hit_rate"] == pytest.approx(1 - a["distinct_pages"] / a["asks"], abs=1e-3)


def test_split_prompts_reuse_every_image_that_recurs_not_only_the_first(figures_run):
    """Split: each image leads its own prompt, so every recurrence of it can hit (the position oracle's reuse),
    where a joint prompt's later images hit only behind the same first image."""
    for name in (PAGE_LEVEL, FIGURE_LEVEL):
        joint, split = levels(figures_run)[name], levels(figures_run)[name + SPLIT]
        assert split["image_hit_rate"] >= joint["image_hit_rate"]
        assert split["image_hit_rate"] >= 0.8 * split["position_oracle_hit_rate"]


def test_the_corpus_is_seeded_and_puts_each_chart_into_its_placements_each_in_another_document(tmp_path):
    spec = FigureCorpusSpec(charts=CHARTS, seed=3, placements=len(ROUNDS))
    a = build_figure_corpus(tmp_path / "a", spec)
    b = build_figure_corpus(tmp_path / "b", spec)
    assert a.placements == b.placements and a.titles == b.titles and len(set(a.titles)) == CHARTS
    for chart in range(CHARTS):
        where = sorted((p for p in a.placements if p.chart == chart), key=lambda p: p.round)
        assert [(p.round, p.layout) for p in where] == [(r, layout) for r, (layout, _) in enumerate(ROUNDS)]
        assert {p.layout for p in where} == {"report", "slide", "appendix"}
        assert len({p.doc for p in where}) == len(where)  # each in another document
    assert len({(p.doc, p.page) for p in a.placements}) == len(a.placements)
    with pytest.raises(ValueError, match="pasted into 1 to"):
        FigureCorpusSpec(placements=len(ROUNDS) + 1)


def test_questions_ask_the_same_charts_at_every_point_of_the_sweep(tmp_path):
    corpus = build_figure_corpus(tmp_path, FigureCorpusSpec(charts=CHARTS, seed=0, placements=len(ROUNDS)))
    sweep = {k: make_questions(corpus, 40, 1.0, 0, k) for k in range(1, len(ROUNDS) + 1)}
    charts = {tuple(q.charts for q in qs) for qs in sweep.values()}
    assert len(charts) == 1  # the same charts, in the same order, at every point
    for k, qs in sweep.items():
        rounds = {p.round for q in qs for p in q.places}
        assert rounds <= set(range(k)) and len(rounds) == k  # through the chart's first k pages, all of them used
        assert all(p.chart == c for q in qs for p, c in zip(q.places, q.charts))
    with pytest.raises(ValueError, match="fewer than"):
        make_questions(build_figure_corpus(tmp_path / "two", FigureCorpusSpec(charts=CHARTS, placements=2)),
                       4, 1.0, 0, 3)


def test_placements_are_counts_within_the_corpus_and_others_are_refused_with_the_range():
    import typer

    from mmrag.bench_cmd import _placements

    assert _placements(None) == (2, 3, 4, 6) and _placements("6, 2,3,2") == (2, 3, 6)
    for bad in ("0", "7", "2,a", ",", ""):
        with pytest.raises(typer.BadParameter, match=f"from 1 to {len(ROUNDS)}"):
            _placements(bad)
