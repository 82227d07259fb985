"""Warm-up against the engine that serves the questions: `mmrag warm` fills a running replica's KV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from core.keys import ImageKey
from mmrag.wiring import resolve_model
from mmrag.wiring import feature_store
from mmrag.ask_cmd import lookup_pages, open_page_index
from core.engine import KVCapacity, PromptPlan, SamplingSpec
from serving.engine.features import FeatureProvider
from serving.engine.remote import RemoteEngine
from serving.warmup import WarmCandidate, fit_to_capacity, rank_by_demand

REPO = Path(__file__).resolve().parents[1]
K = [ImageKey.parse(f"img1-{c * 64}-{'ab' * 8}-px1-2") for c in "abcd"]


def test_demand_ranks_recurring_pages_first_then_by_key():
    ranked = rank_by_demand([(K[2], 10), (K[1], 10), (K[2], 10), (K[0], 10), (K[2], 10), (K[1], 10)])
    assert [(c.key, c.demand) for c in ranked] == [(K[2], 3), (K[1], 2), (K[0], 1)]


def test_only_what_fits_the_kv_share_is_chosen_and_the_rest_reported():
    cands = [WarmCandidate(k, 250, 1) for k in K]
    # 64 + 250 tokens → 10 blocks of 32 each; 40 blocks × 0.5 share = 20 blocks → two pages fit.
    chosen, rest = fit_to_capacity(cands, KVCapacity(blocks=40, block_size=32), prefix_tokens=64, share=0.5)
    assert [c.key for c in chosen] == K[:2] and [c.key for c in rest] == K[2:]


@pytest.fixture
def remote(vllm_server, engine_settings):
    engine = RemoteEngine([vllm_server], resolve_model(engine_settings),
                          FeatureProvider(feature_store(engine_settings)))
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
    env = dict(os.environ, MMRAG_DATA_DIR=str(engine_settings.data_dir), MMRAG_MODEL=engine_settings.model,
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


def test_ingest_with_warm_warms_the_running_replica(vllm_server, engine_settings, sample_corpus, tmp_path):
    slide = sorted(sample_corpus.glob("*.png"))[-1]
    env = dict(os.environ, MMRAG_DATA_DIR=str(tmp_path / "data"), MMRAG_MODEL=engine_settings.model,
               MMRAG_ENGINE_URLS=vllm_server, MMRAG_OCR="false", HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "mmrag", "ingest", str(slide), "--warm", "--json"],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert out["pages"] == 1 and len(out["warm"]["warmed"]) == 1 and out["warm"]["did_not_fit"] == []
