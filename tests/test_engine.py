"""The in-process vLLM engine with the tiny model in fp32: exactness of every cached path, and accounting.

One engine per session (tests/conftest.py). Tests that need a cold start reset the prefix cache first.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from qdrant_client import QdrantClient

from mmrag.core.keys import ImageKey, ResolutionPolicy
from ingestion.loaders import open_document
from mmrag.wiring import feature_store
from mmrag.adapters.vision import VisionEncoder
from mmrag.core.engine import Layout, PromptPlan, SamplingSpec
from serving.engine.inprocess import sampling_params
from serving.warmup import WarmCandidate, warm

GREEDY = SamplingSpec(max_tokens=12)


@pytest.fixture(scope="module")
def pages(engine_settings, ingested) -> list[dict]:
    """Payloads of the ingested pages, one per distinct image key, in key order."""
    client = QdrantClient(path=str(engine_settings.storage.qdrant_path))
    try:
        points, _ = client.scroll(engine_settings.storage.qdrant_collection, limit=1000, with_payload=True)
    finally:
        client.close()
    by_key = {p.payload["image_key"]: p.payload for p in points}
    return [by_key[k] for k in sorted(by_key)]


def key_of(page: dict) -> ImageKey:
    return ImageKey.parse(page["image_key"])


def plan(*keys: ImageKey, text: str = "What does this page show?", layout: Layout = Layout.CANONICAL) -> PromptPlan:
    return PromptPlan(images=keys, text=text, sampling=GREEDY, layout=layout)


def render_page(page: dict, settings):
    with open_document(Path(page["path"]), settings.documents) as doc:
        for rendered in doc.pages():
            if rendered.page == page["page"]:
                return rendered
    raise LookupError(page)


def full_blocks(n_tokens: int, block_size: int) -> int:
    return n_tokens // block_size * block_size


def vllm_counter(name: str) -> float:
    return sum(
        s.value for m in REGISTRY.collect() for s in m.samples if s.name == f"{name}_total" or s.name == name
    )


async def test_a_prefix_hit_gives_the_cold_paths_greedy_tokens(inprocess_engine, pages):
    engine = inprocess_engine
    await engine.reset_prefix_cache()
    cold = await engine.generate(plan(key_of(pages[0])))
    hit = await engine.generate(plan(key_of(pages[0])))
    block = (await engine.kv_capacity()).block_size
    assert cold.usage.cached_image_tokens == 0
    assert hit.token_ids == cold.token_ids and len(cold.token_ids) == GREEDY.max_tokens
    # The whole image prefix lies in full blocks except its tail: at least the image rounded down is cached.
    assert hit.usage.cached_image_tokens >= full_blocks(hit.usage.image_tokens, block) - block
    assert hit.usage.cached_tokens >= full_blocks(pages[0]["image_tokens"], block)
    assert hit.usage.vision_encodes == 0


async def test_identical_plans_build_identical_requests_and_image_order_matters(inprocess_engine, pages):
    engine, r = inprocess_engine, inprocess_engine.renderer
    a, b = key_of(pages[0]), key_of(pages[1])
    feats = await engine.features.load([a, b])
    first, again = engine.build_request(plan(a, b), feats), engine.build_request(plan(a, b), feats)
    assert first["prompt"] == again["prompt"]
    assert first["multi_modal_uuids"] == again["multi_modal_uuids"] == {"image": [str(a), str(b)]}
    swapped = engine.build_request(plan(b, a), feats[::-1])
    assert swapped["multi_modal_uuids"] == {"image": [str(b), str(a)]}
    canonical, naive = r.render(plan(a)), r.render(plan(a, layout=Layout.NAIVE))
    assert canonical.index("<|image_pad|>") < canonical.index("What does this page show?")
    assert naive.index("What does this page show?") < naive.index("<|image_pad|>")


async def test_warm_up_leaves_the_image_prefix_cached_with_the_same_tokens(inprocess_engine, pages):
    engine = inprocess_engine
    key = key_of(pages[1])
    await engine.reset_prefix_cache()
    cold = await engine.generate(plan(key))
    await engine.reset_prefix_cache()
    report = await warm(engine, [WarmCandidate(key, pages[1]["image_tokens"], 1)])
    assert report.warmed == [key] and report.did_not_fit == []
    after = await engine.generate(plan(key))
    assert after.token_ids == cold.token_ids
    assert after.usage.cached_image_tokens >= full_blocks(after.usage.image_tokens, 32) - 32 > 0


async def test_image_embeds_give_the_same_tokens_as_pixels_given_to_vllm(inprocess_engine, pages, engine_settings):
    engine = inprocess_engine
    page = next(p for p in pages if p["doc"].endswith(".png"))
    key = key_of(page)
    await engine.reset_prefix_cache()
    ours = await engine.generate(plan(key))
    image = render_page(page, engine_settings).image
    request = {
        "prompt": engine.renderer.render(plan(key)),
        "multi_modal_data": {"image": image},
        "multi_modal_uuids": {"image": [f"pixels-{uuid.uuid4().hex}"]},  # a fresh uuid: no cache can hit
    }
    tokens = []
    async for out in engine.llm.generate(request, sampling_params(plan(key)), request_id=uuid.uuid4().hex):
        tokens.extend(out.outputs[0].token_ids)
    assert tokens == ours.token_ids


async def test_a_different_image_never_hits_another_images_entry(inprocess_engine, pages):
    engine = inprocess_engine
    await engine.reset_prefix_cache()
    await engine.generate(plan(key_of(pages[2])))
    other = await engine.generate(plan(key_of(pages[3])))
    assert other.usage.cached_image_tokens == 0
    # Only the shared system prompt (the blocks before the first image token) may hit.
    first_image_token = engine.renderer.tokens(engine.renderer.render(plan(key_of(pages[3]))),
                                               [other.usage.image_tokens]).image_spans[0][0]
    assert other.usage.cached_tokens <= first_image_token


async def test_a_new_encoder_version_or_resolution_policy_gets_no_cached_image_tokens(
    inprocess_engine, pages, engine_settings, tiny_model
):
    engine = inprocess_engine
    page = pages[4]
    old_key = key_of(page)
    store = feature_store(engine_settings)
    await engine.reset_prefix_cache()
    await engine.generate(plan(old_key))
    assert (await engine.generate(plan(old_key))).usage.cached_image_tokens > 0

    # Same weights and tokens, new salt: a new encoder version, so a new key — and a cold image prefix.
    salted = VisionEncoder(tiny_model, engine_settings.vision.resolution_policy, salt="bumped")
    new_key = salted.key_for(old_key.content_hash)
    assert new_key != old_key and new_key.encoder_version != old_key.encoder_version
    store.put(new_key, store.get(old_key))
    assert (await engine.generate(plan(new_key))).usage.cached_image_tokens == 0

    # A smaller resolution policy: other tokens (fewer of them) under another key — cold as well.
    policy = ResolutionPolicy(engine_settings.vision.min_pixels, engine_settings.vision.max_pixels // 4)
    smaller = VisionEncoder(tiny_model, policy)
    rendered = render_page(page, engine_settings)
    small_key = smaller.key_for(rendered.content_hash)
    store.put(small_key, smaller.encode([rendered.image])[0])
    small = await engine.generate(plan(small_key))
    assert small.usage.cached_image_tokens == 0
    assert small.usage.image_tokens < page["image_tokens"]
    for key in (new_key, small_key):  # the session store is every test's: it holds the corpus's entries only
        store.delete(key)


async def test_per_request_cached_tokens_agree_with_vllms_own_prefix_counters(inprocess_engine, pages):
    engine = inprocess_engine
    key = key_of(pages[5])
    await engine.reset_prefix_cache()
    await engine.generate(plan(key, text="first question about the figure"))
    hits_before = vllm_counter("vllm:prefix_cache_hits")
    queries_before = vllm_counter("vllm:prefix_cache_queries")
    second = await engine.generate(plan(key, text="a second, different question"))
    block = (await engine.kv_capacity()).block_size
    assert second.usage.cached_tokens >= full_blocks(pages[5]["image_tokens"], block)
    assert vllm_counter("vllm:prefix_cache_hits") - hits_before == second.usage.cached_tokens
    assert vllm_counter("vllm:prefix_cache_queries") - queries_before == second.usage.prompt_tokens


async def test_kv_capacity_comes_from_the_engine_config(inprocess_engine):
    cap = await inprocess_engine.kv_capacity()
    assert cap.block_size == 32 and cap.blocks > 0 and cap.tokens == cap.blocks * 32


async def test_batch_capacity_is_the_engines_max_num_seqs(inprocess_engine, engine_settings):
    assert await inprocess_engine.batch_capacity() == engine_settings.engine.max_num_seqs
