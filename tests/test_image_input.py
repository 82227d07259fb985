"""The two deployment forms (MMRAG_IMAGE_INPUT, serving/engine/images.py) on the session's Qwen2-VL engines, fp32:
pixels sent under mmrag's keys give the greedy tokens of the stored image tokens, cold and from the prefix cache,
in process and over `vllm serve`; a page whose pixels expand to another token count than its stored entry is
stopped; what cannot be sent in a form is refused with the fix. (Qwen2.5-VL and Qwen3-VL: tests/test_families.py.)
"""

from __future__ import annotations

import dataclasses
import re
import uuid

import pytest

from mmrag.adapters.store import DiskFeatureStore
from mmrag.adapters.vision import VisionEncoder
from mmrag.adapters.vision_client import png_bytes
from mmrag.core.engine import ImageInput, PromptPlan, SamplingSpec
from mmrag.core.keys import ContentHash, ResolutionPolicy
from mmrag.core.payload import WITHOUT_PIXELS_FIX
from mmrag import wiring
from serving.engine.features import FeatureProvider
from serving.engine.images import ImageInputError, ImageTokenCountError, PIXELS_UUID_SUFFIX, multi_modal_uuid
from serving.engine.remote import RemoteEngine
from tests.test_engine import render_page

GREEDY = SamplingSpec(max_tokens=12, min_tokens=12)  # the random model may draw its end early: 12 compared
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def encoder(engine_settings) -> VisionEncoder:
    """The session's encoder (same version and policy, so the same keys as ingestion's), keeping pixels."""
    return VisionEncoder(engine_settings.model.name, engine_settings.vision.resolution_policy,
                         salt=engine_settings.vision.encoder_salt,
                         keep_pixels=True)


@pytest.fixture(scope="module")
def pixel_pages(engine_settings, ingested, encoder, tmp_path_factory) -> dict:
    """Three sample pages stored in the pixels form: tokens and pixels (``both``), and pixels only (``bare``)."""
    from qdrant_client import QdrantClient

    client = QdrantClient(path=str(engine_settings.storage.qdrant_path))
    try:
        points, _ = client.scroll(engine_settings.storage.qdrant_collection, limit=1000, with_payload=True)
    finally:
        client.close()
    by_key = {p.payload["image_key"]: p.payload for p in points if p.payload.get("figure") is None}
    payloads = [by_key[k] for k in sorted(by_key)][:3]
    rendered = [render_page(p, engine_settings) for p in payloads]
    images, keys = [r.image for r in rendered], [encoder.key_for(r.content_hash) for r in rendered]
    both = DiskFeatureStore(tmp_path_factory.mktemp("pixels-and-tokens"))
    bare = DiskFeatureStore(tmp_path_factory.mktemp("pixels-only"))
    bare_encoder = VisionEncoder(engine_settings.model.name, engine_settings.vision.resolution_policy,
                                 salt=engine_settings.vision.encoder_salt, keep_pixels=True, tokens=False)
    for key, value, no_tokens in zip(keys, encoder.encode(images), bare_encoder.encode(images), strict=True):
        both.put(key, value)
        bare.put(key, no_tokens)
    assert [str(k) for k in keys] == sorted(by_key)[:3]  # the keys ingestion made: same encoder, same pages
    return {"keys": keys, "images": images, "both": both, "bare": bare}


def on_store(engine, store, form: ImageInput):
    other = engine.with_image_input(form)
    other.features = FeatureProvider.unscoped(store)
    return other


def plan(*keys, text: str = "What does this page show?") -> PromptPlan:
    return PromptPlan(images=keys, text=text, sampling=GREEDY)


async def test_pixels_give_the_embeds_greedy_tokens_cold_and_from_the_prefix_cache(inprocess_engine, pixel_pages):
    keys = pixel_pages["keys"]
    embeds = on_store(inprocess_engine, pixel_pages["both"], ImageInput.EMBEDS)
    pixels = on_store(inprocess_engine, pixel_pages["both"], ImageInput.PIXELS)
    for two in (keys[:2], keys[1:3]):
        await inprocess_engine.reset_prefix_cache()
        cold_embeds = await embeds.generate(plan(*two))
        await inprocess_engine.reset_prefix_cache()
        cold = await pixels.generate(plan(*two))
        hit = await pixels.generate(plan(*two, text="And what else?"))
        again = await pixels.generate(plan(*two))
        assert len(cold.token_ids) == GREEDY.max_tokens and cold.token_ids == cold_embeds.token_ids
        assert again.token_ids == cold.token_ids
        assert cold.usage.image_input == "pixels" and cold_embeds.usage.image_input == "embeds"
        assert cold.usage.image_tokens == cold_embeds.usage.image_tokens  # each page's count is its entry's
        assert cold.usage.cached_image_tokens == 0 and cold.usage.vision_encodes == 2
        # The second prompt shares the two pages: their KV is served from the prefix cache (full blocks).
        assert hit.usage.cached_image_tokens >= cold.usage.image_tokens - 2 * 32 > 0
        assert again.usage.vision_encodes <= 1


async def test_pages_stored_without_tokens_are_served_in_the_pixels_form_only(inprocess_engine, pixel_pages):
    keys = pixel_pages["keys"]
    bare = on_store(inprocess_engine, pixel_pages["bare"], ImageInput.PIXELS)
    await inprocess_engine.reset_prefix_cache()
    with_tokens = await on_store(inprocess_engine, pixel_pages["both"], ImageInput.EMBEDS).generate(plan(keys[0]))
    await inprocess_engine.reset_prefix_cache()
    assert (await bare.generate(plan(keys[0]))).token_ids == with_tokens.token_ids
    with pytest.raises(ImageInputError, match="MMRAG_INGEST_IMAGE_TOKENS=true"):
        await on_store(inprocess_engine, pixel_pages["bare"], ImageInput.EMBEDS).generate(plan(keys[0]))


async def test_an_entry_without_pixels_is_refused_in_the_pixels_form_with_the_fix(inprocess_engine, ingested):
    # The session's pages were ingested in the embeds form: their entries hold tokens only.
    pixels = inprocess_engine.with_image_input(ImageInput.PIXELS)
    key = next(iter(pixels.features.store.keys()))
    with pytest.raises(ImageInputError, match=re.escape(WITHOUT_PIXELS_FIX)):
        await pixels.generate(plan(key))


async def test_pixels_whose_token_count_differs_from_the_stored_entry_are_stopped(inprocess_engine, encoder,
                                                                                 pixel_pages, tmp_path):
    # The entry of page 0 with a smaller picture's pixels (so another token count): vLLM would
    # expand it to that picture's count, and the cached-image accounting would name the wrong spans.
    # (Under a key vLLM has not seen: under a seen one its processor cache would serve what it processed then.)
    keys, images, store = pixel_pages["keys"], pixel_pages["images"], pixel_pages["both"]
    entry = store.get(keys[0])
    other = images[0].resize((112, 112))  # 16 tokens where the page has hundreds
    unseen = encoder.key_for(ContentHash(uuid.uuid4().hex * 2))
    wrong = DiskFeatureStore(tmp_path)
    wrong.put(unseen, dataclasses.replace(entry, pixels_png=png_bytes(other)))
    with pytest.raises(ImageTokenCountError, match="resized the pixels otherwise"):
        await on_store(inprocess_engine, wrong, ImageInput.PIXELS).generate(plan(unseen))
    # The engine is unharmed: the same page with its own pixels is answered.
    assert (await on_store(inprocess_engine, store, ImageInput.PIXELS).generate(plan(keys[0]))).token_ids


async def test_a_pooled_key_is_sent_as_tokens_in_the_pixels_form(inprocess_engine, engine_settings, pixel_pages,
                                                               tmp_path):
    pooled = ResolutionPolicy(engine_settings.vision.min_pixels, engine_settings.vision.max_pixels, pool=2)
    encoder = VisionEncoder(engine_settings.model.name, pooled, salt=engine_settings.vision.encoder_salt,
                            keep_pixels=True)
    (value,) = encoder.encode(pixel_pages["images"][:1])
    assert value.pixels_png is None  # pooling is after the projector: vLLM's encoder cannot make these tokens
    key = encoder.key_for(pixel_pages["keys"][0].content_hash)
    store = DiskFeatureStore(tmp_path)
    store.put(key, value)
    done = await on_store(inprocess_engine, store, ImageInput.PIXELS).generate(plan(key))
    assert done.usage.image_input == "embeds" and done.usage.image_tokens == value.num_tokens


def test_the_pixels_form_keys_vllms_caches_by_the_image_key_apart_from_the_embeds_form(pixel_pages):
    key = pixel_pages["keys"][0]
    assert multi_modal_uuid(key, ImageInput.EMBEDS) == str(key)
    assert multi_modal_uuid(key, ImageInput.PIXELS) == str(key) + PIXELS_UUID_SUFFIX


def test_stored_pixels_decode_to_the_hashed_page(pixel_pages):
    from ingestion.loaders import image_content_hash
    from serving.engine.images import decode_pixels

    entries = [pixel_pages["both"].get(k) for k in pixel_pages["keys"]]
    for key, image in zip(pixel_pages["keys"], decode_pixels(entries), strict=True):
        assert image_content_hash(image) == key.content_hash


async def test_over_vllm_serve_pixels_give_the_embeds_greedy_tokens_cold_and_cached(vllm_server, engine_settings,
                                                                                    pixel_pages):
    keys = pixel_pages["keys"]
    # The replica runs the session's embeds-form configuration (no per-request processor settings): the
    # standard tier's pixels need none, its processor is set to that tier's bounds.
    remote = RemoteEngine([vllm_server], wiring.resolve_model(engine_settings),
                          FeatureProvider.unscoped(pixel_pages["both"]),
                          image_pixels=(engine_settings.vision.min_pixels, engine_settings.vision.max_pixels))
    try:
        await remote.reset_prefix_cache()
        embeds = await remote.generate(plan(keys[0], keys[2]))
        await remote.reset_prefix_cache()
        pixels = remote.with_image_input(ImageInput.PIXELS)
        cold = await pixels.generate(plan(keys[0], keys[2]))
        hit = await pixels.generate(plan(keys[0], keys[2]))
        assert cold.token_ids == embeds.token_ids == hit.token_ids and len(cold.token_ids) == GREEDY.max_tokens
        assert (cold.usage.image_input, embeds.usage.image_input) == ("pixels", "embeds")
        assert hit.usage.cached_image_tokens >= hit.usage.image_tokens - 2 * 32 > 0
        assert cold.usage.vision_encodes == 2 and hit.usage.vision_encodes <= 1
        sent = remote.bytes_sent
        assert sent["pixels"] > 0 and sent["embeds"] > 0  # both forms counted, on the shared counter
    finally:
        await remote.close()


async def test_warm_up_in_the_pixels_form_leaves_the_page_encoded_and_its_kv_resident(inprocess_engine, pixel_pages):
    from serving.warmup import WarmCandidate, warm

    keys, store = pixel_pages["keys"], pixel_pages["both"]
    pixels = on_store(inprocess_engine, store, ImageInput.PIXELS)
    await inprocess_engine.reset_prefix_cache()
    report = await warm(pixels, [WarmCandidate(keys[2], store.get(keys[2]).num_tokens, demand=3)])
    assert report.warmed == [keys[2]]
    asked = await pixels.generate(plan(keys[2], keys[0]))
    first = asked.usage.image_tokens - store.get(keys[0]).num_tokens  # the warmed page leads the prompt
    # The warmed page's KV, up to its last full block (the partial block past it is recomputed, its encoder
    # output from vLLM's encoder cache, which vLLM does not count: vision_encodes is an upper bound).
    assert asked.usage.cached_image_tokens >= first - 32 > 0


async def test_the_pixels_form_keeps_tenants_caches_apart(inprocess_engine, pixel_pages):
    keys = pixel_pages["keys"]
    pixels = on_store(inprocess_engine, pixel_pages["both"], ImageInput.PIXELS)
    await inprocess_engine.reset_prefix_cache()
    ours = dataclasses.replace(plan(keys[1]), cache_salt="tenant-a")
    first = await pixels.generate(ours)
    again = await pixels.generate(ours)
    theirs = await pixels.generate(dataclasses.replace(ours, cache_salt="tenant-b"))
    assert again.usage.cached_image_tokens > 0 and theirs.usage.cached_image_tokens == 0
    assert first.token_ids == again.token_ids == theirs.token_ids


async def test_another_unpooled_tier_is_resized_by_vllm_under_its_own_policy(inprocess_engine, engine_settings,
                                                                             pixel_pages, tmp_path):
    # The engine's processor is set to the standard tier; a request under another tier names that tier's bounds.
    high = ResolutionPolicy(engine_settings.vision.min_pixels, 4 * engine_settings.vision.max_pixels)
    encoder = VisionEncoder(engine_settings.model.name, high, salt=engine_settings.vision.encoder_salt,
                            keep_pixels=True)
    (value,) = encoder.encode(pixel_pages["images"][:1])
    key = encoder.key_for(pixel_pages["keys"][0].content_hash)
    store = DiskFeatureStore(tmp_path)
    store.put(key, value)
    standard = pixel_pages["both"].get(pixel_pages["keys"][0]).num_tokens
    assert value.num_tokens > standard  # really another resize
    await inprocess_engine.reset_prefix_cache()
    embeds = await on_store(inprocess_engine, store, ImageInput.EMBEDS).generate(plan(key))
    pixels = await on_store(inprocess_engine, store, ImageInput.PIXELS).generate(plan(key))
    assert pixels.usage.image_input == "pixels" and pixels.usage.image_tokens == value.num_tokens
    assert pixels.token_ids == embeds.token_ids


def test_the_setting_reaches_every_engine_and_the_encoder(engine_settings):
    """MMRAG_IMAGE_INPUT=pixels: the in-process engine's config (Ray's replicas run wiring.replica_engine, the same
    wiring.engine), `mmrag engine serve`'s flags, the remote engine, and the encoder that ingests (keeping pixels)."""
    from mmrag.core.settings import Settings

    pixels = engine_settings.replace(**{"image_input": "pixels"})
    config = wiring.engine_config(pixels)
    assert config.image_input is ImageInput.PIXELS
    assert config.image_pixels == (pixels.vision.min_pixels, pixels.vision.max_pixels)
    flags = config.serve_flags()
    assert "--trust-request-mm-kwargs" in flags and "--mm-processor-kwargs" in flags
    assert "--trust-request-mm-kwargs" not in wiring.engine_config(engine_settings).serve_flags()
    remote = wiring.engine(pixels.replace(**{"engine_urls": ["http://127.0.0.1:9"]}),
                           wiring.resolve_model(pixels))
    assert remote.image_input is ImageInput.PIXELS and remote.image_pixels == config.image_pixels
    encoder = wiring.vision_encoder(pixels.replace(**{"ingest_image_tokens": False}),
                                    wiring.resolve_model(pixels))
    assert encoder.keep_pixels and not encoder.makes_tokens
    with pytest.raises(ValueError, match="MMRAG_IMAGE_INPUT=pixels"):
        Settings(model=engine_settings.model.name, data_dir=engine_settings.storage.data_dir, ingest_image_tokens=False)
