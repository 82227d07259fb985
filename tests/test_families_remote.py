"""Qwen3-VL over `vllm serve`: its image tokens travel as JSON `image_embeds` (the merged tokens with the
deepstack features beside them, one row per image token) and the replica gives the tokens it gives for the
pixels, and a prefix hit gives the cold path's tokens, in fp32.

One replica of the Qwen3-VL tiny model for this module. Qwen2-VL's HTTP path is tests/test_remote_engine.py;
Qwen2.5-VL's image_embeds have Qwen2-VL's layout (tests/test_families.py proves it in-process).
"""

from __future__ import annotations

import base64
import io
import os
import uuid

import httpx
import pytest

from mmrag.adapters.checkpoint import ModelSource
from mmrag.adapters.store import DiskFeatureStore
from mmrag.adapters.vision import VisionEncoder
from mmrag.core.engine import ImageInput, PromptPlan, SamplingSpec
from mmrag.core.keys import ContentHash
from mmrag.devkit.tiny_model import MODEL_NAMES, build_tiny_model
from serving.engine.config import EngineConfig
from serving.engine.features import FeatureProvider
from serving.engine.remote import RemoteEngine, sampling_fields
from serving.vllm_launch import start_server
from tests.conftest import free_port
from tests.test_vision import POLICY, noise_images

FAMILY = "qwen3_vl"
GREEDY = SamplingSpec(max_tokens=12)
BLOCK = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ModelSource:
    return ModelSource(build_tiny_model(tmp_path_factory.mktemp(FAMILY) / "tiny", family=FAMILY), MODEL_NAMES[FAMILY],
                       True)


@pytest.fixture(scope="module")
def stored(model, tmp_path_factory):
    """Two images' tokens stored as ingestion stores them in the pixels form (their pixels beside), with the
    images."""
    store = DiskFeatureStore(tmp_path_factory.mktemp(f"{FAMILY}-features"))
    encoder = VisionEncoder(model.path, POLICY, keep_pixels=True)
    images = noise_images()[:2]
    keys = []
    for i, encoded in enumerate(encoder.encode(images)):
        key = encoder.key_for(ContentHash(f"{i + 7:02x}" * 32))
        store.put(key, encoded)
        keys.append(key)
    return store, keys, images


@pytest.fixture(scope="module")
def replica(model, tmp_path_factory):
    """The replica's process, started and not yet ready: it boots while ``stored`` encodes (``engine`` asks for
    this fixture first)."""
    # The pixels form's replica (it takes each request's processor bounds: no image_pixels of its own); the embeds
    # form sends none, so one replica serves both.
    config = EngineConfig(block_size=BLOCK, kv_cache_gib=1, max_model_len=2048, max_images_per_prompt=2,
                          enforce_eager=True, dtype="float32", max_num_seqs=4, image_input=ImageInput.PIXELS)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
    try:
        handle = start_server(model.path, config, port=free_port(),
                              log_path=tmp_path_factory.mktemp("qwen3-serve") / "server.log")
    finally:
        del os.environ["VLLM_SERVER_DEV_MODE"]
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
async def engine(model, replica, stored):
    replica.wait_ready(timeout=300)
    eng = RemoteEngine([replica.url], model, FeatureProvider.unscoped(stored[0]))
    yield eng
    await eng.close()


def _plan(key) -> PromptPlan:
    return PromptPlan(images=(key,), text="What does this page show?", sampling=GREEDY)


async def _pixel_tokens(eng: RemoteEngine, plan: PromptPlan, image) -> list[int]:
    """The replica's greedy tokens for the same chat with the image as a PNG: vLLM runs its own encoder."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
            "uuid": f"pixels-{uuid.uuid4().hex}"}
    url = eng.urls[0]
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        response = await client.post(f"{url}/v1/chat/completions", json={
            "model": model, "messages": eng.renderer.messages(plan, [part]), **sampling_fields(plan),
            "return_token_ids": True,
        })
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("index", [0, 1])  # a 448-pixel square, a 500x300 page
async def test_image_embeds_over_http_give_the_pixels_tokens(engine, stored, index):
    _, keys, images = stored
    plan = _plan(keys[index])
    await engine.reset_prefix_cache()
    ours = await engine.generate(plan)
    pixels = await _pixel_tokens(engine, plan, images[index])
    assert len(ours.token_ids) == GREEDY.max_tokens and ours.token_ids == pixels


async def test_a_prefix_hit_over_http_gives_the_cold_paths_tokens(engine, stored):
    _, keys, _ = stored
    await engine.reset_prefix_cache()
    cold = await engine.generate(_plan(keys[0]))
    hit = await engine.generate(_plan(keys[0]))
    assert cold.usage.cached_image_tokens == 0
    assert hit.usage.cached_image_tokens >= hit.usage.image_tokens // BLOCK * BLOCK - BLOCK > 0
    assert hit.token_ids == cold.token_ids
    other = await engine.generate(_plan(keys[1]))
    assert other.token_ids != cold.token_ids  # the tokens depend on the image, so the equalities mean something


async def test_the_pixels_form_over_http_gives_the_embeds_forms_tokens_cold_and_cached(engine, stored):
    """MMRAG_IMAGE_INPUT=pixels to a `vllm serve` replica: the stored PNG as a data URL under the key (+pixels)
    as uuid, resized by the replica under the key's policy (per-request processor bounds)."""
    _, keys, _ = stored
    pixels = engine.with_image_input(ImageInput.PIXELS)
    await engine.reset_prefix_cache()
    embeds = [await engine.generate(_plan(k)) for k in keys]
    await engine.reset_prefix_cache()
    for key, want in zip(keys, embeds, strict=True):
        cold = await pixels.generate(_plan(key))
        hit = await pixels.generate(_plan(key))
        assert (cold.usage.image_input, want.usage.image_input) == ("pixels", "embeds")
        assert cold.token_ids == want.token_ids == hit.token_ids
        assert cold.usage.image_tokens == want.usage.image_tokens and cold.usage.vision_encodes == 1
        assert hit.usage.cached_image_tokens >= hit.usage.image_tokens // BLOCK * BLOCK - BLOCK > 0
