"""Warm-up against the engine that serves the questions: `mmrag warm` fills a running replica's KV."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mmrag.core.keys import ImageKey
from mmrag.wiring import resolve_model
from mmrag.wiring import feature_store
from mmrag.ask_cmd import lookup_pages, open_page_index
from mmrag.core.engine import KVCapacity, PromptPlan, SamplingSpec
from serving.engine.features import FeatureProvider
from serving.engine.remote import RemoteEngine
from serving.warmup import WarmCandidate, fit_to_capacity, leading_images, rank_by_demand
from mmrag.core.figures import FigureRegion, PageFigure
from mmrag.core.pages import TextSource
from mmrag.core.payload import PagePayload

REPO = Path(__file__).resolve().parents[1]
K = [ImageKey.parse(f"img1-{c * 64}-{'ab' * 8}-px1-2") for c in "abcd"]


def test_demand_ranks_recurring_pages_first_then_by_key():
    ranked = rank_by_demand([(K[2], 10), (K[1], 10), (K[2], 10), (K[0], 10), (K[2], 10), (K[1], 10)])
    assert [(c.key, c.demand) for c in ranked] == [(K[2], 3), (K[1], 2), (K[0], 1)]


def _page(doc: str, key: ImageKey, *crops: ImageKey) -> PagePayload:
    figures = tuple(PageFigure(FigureRegion(i + 1, "figure", f"Figure {i + 1}: a chart", (10, 20, 110, 220), "raster"),
                               crop, 64) for i, crop in enumerate(crops))
    return PagePayload(doc_id=doc, doc=doc, path=doc, page=1, num_pages=1, file_sha256="0", content_hash="0",
                       image_key=key, image_tokens=256, width=64, height=64, text="", text_source=TextSource.TEXT_LAYER,
                       fingerprint="f", figures=figures)


def test_the_crop_of_a_figure_no_hit_can_name_is_not_warmed_unless_pixels_find_it():
    """An uncaptioned, unnumbered figure (a logo or a chart pasted on slides) is named by no question's words,
    so without a page-image channel no hit shows its crop: warming it would spend KV on a prefix never asked."""
    plain = PageFigure(FigureRegion(None, "image", "", (10, 20, 110, 220), "raster"), K[3], 64)
    pages = [dataclasses.replace(_page(doc, key), figures=(plain,)) for doc, key in (("a", K[0]), ("b", K[1]))]
    assert [c.key for c in rank_by_demand(leading_images(pages, figure_crops=True))] == [K[0], K[1]]
    ranked = rank_by_demand(leading_images(pages, figure_crops=True, by_pixels=True))
    assert [(c.key, c.demand) for c in ranked] == [(K[3], 2), (K[0], 1), (K[1], 1)]
    # On a slide, its lone uncaptioned chart is named by the slide's title (mmrag/core/figures.py hit_figure).
    slide = dataclasses.replace(pages[0], captions=("Headcount by team: where we stand",))
    assert [(c.key, c.demand) for c in rank_by_demand(leading_images([slide, pages[1]], figure_crops=True))] == \
        [(K[0], 1), (K[1], 1), (K[3], 1)]
    short = dataclasses.replace(pages[0], captions=("Agenda",))  # one term: no question matches it (two needed)
    assert [c.key for c in rank_by_demand(leading_images([short], figure_crops=True))] == [K[0]]


def test_with_figure_crops_in_prompts_a_figure_pasted_into_several_pages_is_warmed_first():
    """A chart pasted into three documents is three pages of demand one each, but ONE crop of demand three: with
    MMRAG_FIGURE_CROPS its crop leads every prompt that asks about it, so it ranks before any page."""
    pages = [_page("report.pdf", K[0], K[3]), _page("deck.pdf", K[1], K[3]), _page("appendix.pdf", K[2], K[3])]
    assert [(c.key, c.demand) for c in rank_by_demand(leading_images(pages, figure_crops=False))] == \
        [(K[0], 1), (K[1], 1), (K[2], 1)]
    ranked = rank_by_demand(leading_images(pages, figure_crops=True))
    assert [(c.key, c.demand, c.image_tokens) for c in ranked] == [(K[3], 3, 64), (K[0], 1, 256), (K[1], 1, 256),
                                                                   (K[2], 1, 256)]


def test_only_what_fits_the_kv_share_is_chosen_and_the_rest_reported():
    cands = [WarmCandidate(k, 250, 1) for k in K]
    # 64 + 250 tokens → 10 blocks of 32 each; 40 blocks × 0.5 share = 20 blocks → two pages fit.
    chosen, rest = fit_to_capacity(cands, KVCapacity(blocks=40, block_size=32), prefix_tokens=64, share=0.5)
    assert [c.key for c in chosen] == K[:2] and [c.key for c in rest] == K[2:]


@pytest.fixture
def remote(vllm_server, engine_settings):
    engine = RemoteEngine([vllm_server], resolve_model(engine_settings),
                          FeatureProvider.unscoped(feature_store(engine_settings)))
    httpx.post(f"{vllm_server}/reset_prefix_cache", timeout=30).raise_for_status()
    yield engine


def page_key(settings, doc: str, page: int) -> ImageKey:
    index = open_page_index(settings)
    try:
        return lookup_pages(index, [(doc, page)])[0].image_key
    finally:
        index.client.close()


async def test_mmrag_warm_fills_the_running_replica_and_later_questions_hit(remote, vllm_server, engine_settings):
    warmed = page_key(engine_settings, "page_cache_paper.pdf", 3)
    control = page_key(engine_settings, "page_cache_paper.pdf", 4)
    env = dict(os.environ, MMRAG_DATA_DIR=str(engine_settings.storage.data_dir), MMRAG_MODEL=engine_settings.model.name,
               MMRAG_ENGINE_URLS=vllm_server, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "mmrag", "warm", "--pages", "page_cache_paper.pdf:3", "--json"],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["warmed"] == [str(warmed)] and report["did_not_fit"] == []
    sampling = SamplingSpec(max_tokens=4)
    hit = await remote.generate(PromptPlan(images=(warmed,), text="What is plotted?", sampling=sampling))
    cold = await remote.generate(PromptPlan(images=(control,), text="What is plotted?", sampling=sampling))
    assert hit.usage.cached_image_tokens >= hit.usage.image_tokens // 32 * 32 - 32 > 0
    assert cold.usage.cached_image_tokens == 0


async def test_ingest_warm_and_ask_with_a_tenant_land_in_its_salt_and_collection(vllm_server, engine_settings,
                                                                                sample_corpus, tmp_path):
    """`mmrag ingest --tenant acme --warm` and `mmrag ask --tenant acme` against a shared `vllm serve`: the page
    goes to acme's collection, and its KV lands under acme's cache salt: a salted request hits it, an unsalted
    one (the default tenant's) does not. Both used to write the default tenant's namespace."""
    from mmrag.core.scope import cache_salt

    slide = sorted(sample_corpus.glob("*.png"))[-1]
    data = tmp_path / "data"
    # OCR on: the slide has no text layer, and with the image channel off a page without text is never retrieved.
    env = dict(os.environ, MMRAG_DATA_DIR=str(data), MMRAG_MODEL=engine_settings.model.name,
               MMRAG_ENGINE_URLS=vllm_server, MMRAG_OCR="true", HF_HUB_OFFLINE="1")

    def cli(*args: str) -> dict:  # the commands under test, as a user runs them, each printing JSON
        result = subprocess.run([sys.executable, "-m", "mmrag", *args, "--json"], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout)

    def pages(*tenant: str) -> int:
        """`mmrag index stats [--tenant T]`'s page count: the same command, run in this process (an observer: a
        process of its own would add seconds of imports and prove nothing more)."""
        from typer.testing import CliRunner

        from mmrag.cli import app

        result = CliRunner().invoke(app, ["index", "stats", *tenant],
                                    env={k: env[k] for k in ("MMRAG_DATA_DIR", "MMRAG_MODEL", "MMRAG_OCR")})
        assert result.exit_code == 0, (result.output, result.exception)
        return json.loads(result.stdout)["pages"]

    remote = RemoteEngine([vllm_server], resolve_model(engine_settings),
                          FeatureProvider.unscoped(feature_store(engine_settings.replace(**{"data_dir": data}))))
    sampling = SamplingSpec(max_tokens=4)

    async def cached(key: ImageKey, salt: str) -> int:
        done = await remote.generate(PromptPlan(images=(key,), text="What is plotted?", sampling=sampling,
                                                cache_salt=salt))
        return done.usage.cached_image_tokens

    salt = cache_salt("acme")
    httpx.post(f"{vllm_server}/reset_prefix_cache", timeout=30).raise_for_status()
    out = cli("ingest", str(slide), "--tenant", "acme", "--warm")
    assert out["pages"] == 1 and len(out["warm"]["warmed"]) == 1 and out["warm"]["did_not_fit"] == []
    assert pages("--tenant", "acme") == 1 and pages() == 0
    key = ImageKey.parse(out["warm"]["warmed"][0])
    assert await cached(key, "") == 0  # the default tenant's namespace holds nothing of it
    assert await cached(key, salt) > 0  # acme's holds the warmed page

    httpx.post(f"{vllm_server}/reset_prefix_cache", timeout=30).raise_for_status()
    answer = cli("ask", "What does the slide show?", "--tenant", "acme", "--max-tokens", "4")
    assert [c["doc"] for c in answer["citations"]] == [slide.name], answer
    assert await cached(key, "") == 0
    assert await cached(key, salt) > 0  # the question prefilled the page under acme's salt
    await remote.close()
