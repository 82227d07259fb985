"""Grid-preserving 2x2 pooling after the projector: a quarter of the tokens, a grid vLLM positions, its own key,
and exact (fp32) greedy tokens cold and from the prefix cache, like every other cached path."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from qdrant_client import QdrantClient

from mmrag.adapters.vision import VisionEncoder, pool_grid
from mmrag.core.engine import PromptPlan, SamplingSpec
from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy
from mmrag.core.pages import EncodedImage
from mmrag.core.settings import Settings
from ingestion.loaders import open_document
from mmrag.wiring import feature_store

GREEDY = SamplingSpec(max_tokens=12, min_tokens=12)  # the random model may draw its end early: 12 compared
STANDARD = ResolutionPolicy(56 * 56, 448 * 448)
POOLED = ResolutionPolicy(56 * 56, 448 * 448, pool=2)


def test_pool_grid_averages_each_2x2_square_of_the_merged_grid_in_row_major_order():
    # 1 frame, 8x12 patches, merge 2: a 4x6 grid of merged tokens, token i holding the value i in every column.
    tokens = torch.arange(24, dtype=torch.float32).reshape(24, 1).repeat(1, 3)
    pooled = pool_grid(EncodedImage(tokens, torch.tensor([[1, 8, 12]])), merge=2, pool=2)
    assert pooled.grid_thw.tolist() == [[1, 4, 6]]
    t, h, w = pooled.grid_thw[0].tolist()
    assert pooled.num_tokens == t * h * w // 2**2 == 24 // 4  # vLLM's count from the grid is the token count
    # Square (0, 0) holds tokens 0, 1, 6, 7; square (1, 2) holds 16, 17, 22, 23.
    assert pooled.image_tokens[0].tolist() == [3.5] * 3 and pooled.image_tokens[5].tolist() == [19.5] * 3


def test_a_grid_that_does_not_divide_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="multiple of patch"):
        pool_grid(EncodedImage(torch.zeros(6, 2), torch.tensor([[1, 4, 6]])), merge=2, pool=2)


def test_pooled_and_unpooled_keys_differ_and_the_unpooled_form_is_unchanged():
    content, version = ContentHash("ab" * 32), EncoderVersion("cd" * 8)
    plain, pooled = ImageKey(content, version, STANDARD), ImageKey(content, version, POOLED)
    assert str(plain) == f"img1-{content}-{version}-px3136-200704"  # what keys stored before pooling read
    assert str(pooled) == f"img1-{content}-{version}-px3136-200704-pool2" != str(plain)
    assert ImageKey.parse(str(pooled)) == pooled and ImageKey.parse(str(plain)) == plain
    assert pooled.in_policy(STANDARD) == plain
    with pytest.raises(ValueError, match="no -pool part"):
        ImageKey.parse(f"{plain}-pool1")
    with pytest.raises(ValueError, match="pool must be 1"):
        ResolutionPolicy(56 * 56, 448 * 448, pool=3)


@pytest.fixture(scope="module")
def encoders(tiny_model) -> tuple[VisionEncoder, VisionEncoder]:
    standard = VisionEncoder(tiny_model, STANDARD)
    return standard, standard.with_policy(POOLED)


def test_the_pooled_encoder_gives_a_quarter_of_the_tokens_on_a_grid_vllm_counts(encoders, sample_corpus):
    standard, pooled = encoders
    assert pooled.tower is standard.tower and pooled.version == standard.version  # one tower, one version
    with open_document(sorted(sample_corpus.glob("*.pdf"))[0], Settings(ocr=False).documents) as doc:
        page = next(doc.pages())
    plain, small = standard.encode([page.image])[0], pooled.encode([page.image])[0]
    t, h, w = small.grid_thw[0].tolist()
    assert small.num_tokens == t * h * w // 4 == pooled.num_tokens_for(page.image)
    assert h % 2 == 0 and w % 2 == 0  # the pooled grid still merges 2x2 in vLLM's count
    print(f"\npooled page {page.image.size}: {plain.num_tokens} tokens unpooled, {small.num_tokens} pooled")
    assert 3 * small.num_tokens <= plain.num_tokens
    assert pooled.forwards == 1 and standard.forwards == 1  # each view counts its own forwards


@pytest.fixture(scope="module")
def pooled_page(engine_settings, ingested, tiny_model) -> Iterator[tuple[ImageKey, ImageKey, int]]:
    """A PNG page of the session corpus: its indexed (standard) key, its pooled key with tokens stored, their
    token counts. The pooled entry goes again afterwards: other tests count the session store's entries."""
    client = QdrantClient(path=str(engine_settings.storage.qdrant_path))
    try:
        points, _ = client.scroll(engine_settings.storage.qdrant_collection, limit=1000, with_payload=True)
    finally:
        client.close()
    page = sorted((p.payload for p in points if p.payload["doc"].endswith(".png")), key=lambda p: p["image_key"])[0]
    standard = VisionEncoder(tiny_model, engine_settings.vision.resolution_policy)
    pooled = standard.with_policy(dataclasses.replace(standard.policy, pool=2))  # the session's bounds, pooled
    with open_document(Path(page["path"]), engine_settings.documents) as doc:
        image = next(r for r in doc.pages() if r.page == page["page"]).image
    key = pooled.key_for(ImageKey.parse(page["image_key"]).content_hash)
    store = feature_store(engine_settings)
    store.put(key, pooled.encode([image])[0])
    yield ImageKey.parse(page["image_key"]), key, page["image_tokens"]
    store.delete(key)


async def test_pooled_tokens_give_the_same_greedy_tokens_cold_and_from_the_prefix_cache(inprocess_engine,
                                                                                      pooled_page):
    engine = inprocess_engine
    standard, pooled, standard_tokens = pooled_page
    plan = PromptPlan(images=(pooled,), text="What does this page show?", sampling=GREEDY)
    await engine.reset_prefix_cache()
    cold = await engine.generate(plan)
    hit = await engine.generate(plan)
    block = (await engine.kv_capacity()).block_size
    assert cold.usage.cached_image_tokens == 0 and len(cold.token_ids) == GREEDY.max_tokens
    assert hit.token_ids == cold.token_ids
    # Every image token in a full KV block is served from the cache: up to the image's last full block.
    (start, n), = engine.renderer.tokens(engine.renderer.render(plan), [cold.usage.image_tokens]).image_spans
    assert hit.usage.cached_image_tokens >= min(n, (start + n) // block * block - start) > 0
    assert 3 * cold.usage.image_tokens <= standard_tokens
    print(f"\npooled prompt: {cold.usage.image_tokens} image tokens (unpooled {standard_tokens}), "
          f"{hit.usage.cached_image_tokens} from the cache on the second request, greedy tokens equal")


async def test_pooled_and_unpooled_tokens_of_one_page_never_share_a_cache_entry(inprocess_engine, pooled_page):
    engine = inprocess_engine
    standard, pooled, _ = pooled_page
    await engine.reset_prefix_cache()
    await engine.generate(PromptPlan(images=(standard,), text="What does this page show?", sampling=GREEDY))
    other = await engine.generate(PromptPlan(images=(pooled,), text="What does this page show?", sampling=GREEDY))
    assert other.usage.cached_image_tokens == 0
