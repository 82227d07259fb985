"""The model-family registry, and the Qwen2-VL proofs repeated in fp32 for Qwen2.5-VL (window attention) and
Qwen3-VL (deepstack features).

The family-parametrized fixtures are module-scoped, so pytest runs one family's tests after the other: one extra
in-process vLLM per family, one at a time (the session engine of tests/conftest.py serves Qwen2-VL).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # any accidental hub lookup fails fast

import dataclasses
import json
import re
import time
import uuid
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, PreTrainedModel
from typer.testing import CliRunner

from mmrag.adapters.checkpoint import ModelSource, read_marker
from mmrag.adapters.families import FAMILIES, UnsupportedFamilyError, family_for
from mmrag.adapters.store import DiskFeatureStore
from mmrag.adapters.vision import VisionEncoder
from mmrag.adapters.vision_client import png_bytes
from mmrag.core.engine import ImageInput, PromptPlan, SamplingSpec
from mmrag.core.keys import ContentHash, ImageKey
from mmrag.devkit.tiny_model import MODEL_NAMES, build_tiny_model
from mmrag.cli import app
from serving.engine.config import EngineConfig
from serving.engine.features import FeatureProvider
from serving.engine.inprocess import InProcessEngine, sampling_params
from tests.test_vision import POLICY, copy_checkpoint, noise_images

GREEDY = SamplingSpec(max_tokens=12)
BLOCK = 32
# Per family: what its tiny checkpoint must show, and a vision config edit that changes the tokens but no
# tensor (the encoder version must change with it).
TINY = {
    "qwen2_5_vl": {"processor": "Qwen2_5_VLProcessor", "width": 256, "patch": 14,
                   "vision": {"window_size": 112, "fullatt_block_indexes": [1]},  # block 0 windowed, 1 full
                   "token_changing_edit": {"fullatt_block_indexes": [0, 1]}},
    "qwen3_vl": {"processor": "Qwen3VLProcessor", "width": 2 * 256, "patch": 16,  # merged + 1 deepstack level
                 "vision": {"deepstack_visual_indexes": [0]},
                 "token_changing_edit": {"deepstack_visual_indexes": [1]}},
}


@pytest.fixture(scope="module", params=sorted(TINY))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(family) / "tiny", family=family)


@pytest.fixture(scope="module")
def encoder(model_dir) -> VisionEncoder:
    return VisionEncoder(model_dir, POLICY)


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    return noise_images()


# --- the registry ------------------------------------------------------------------------------------------


def test_the_registry_names_each_supported_family_by_model_type():
    assert set(FAMILIES) == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
    for model_type, family in FAMILIES.items():
        assert family_for(model_type) is family and family.model_type == model_type
        assert family.image_placeholder == "<|vision_start|><|image_pad|><|vision_end|>"
        assert family.image_pad_token == "<|image_pad|>"
    assert [m for m, f in FAMILIES.items() if f.deepstack] == ["qwen3_vl"]
    # The tower class is named, imported when a tower is built: each name resolves to a transformers model.
    towers = {m: f.tower_class for m, f in FAMILIES.items()}
    assert {m: c.__name__ for m, c in towers.items()} == {
        "qwen2_vl": "Qwen2VisionTransformerPretrainedModel", "qwen2_5_vl": "Qwen2_5_VisionTransformerPretrainedModel",
        "qwen3_vl": "Qwen3VLVisionModel"}
    assert all(issubclass(c, PreTrainedModel) for c in towers.values())


@pytest.mark.parametrize("model_type", ["llava", "qwen3_vl_moe", "qwen2_vl_text"])
def test_any_other_model_type_is_refused_with_the_supported_families(model_type):
    with pytest.raises(UnsupportedFamilyError,
                       match=rf"'{model_type}'.*qwen2_vl \(Qwen2-VL\), qwen2_5_vl \(Qwen2.5-VL\), qwen3_vl "):
        family_for(model_type)


def test_a_checkpoint_of_an_unsupported_family_is_refused_at_load(model_dir, tmp_path):
    copy = copy_checkpoint(model_dir, tmp_path / "other-family")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"model_type": "qwen2_vl_text"}))
    with pytest.raises(ValueError, match="supported families: qwen2_vl"):
        VisionEncoder(copy, POLICY)


# --- each family's tiny checkpoint and vision-only encoder --------------------------------------------------


def test_the_tiny_checkpoint_is_of_its_family(family, model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    vision, tiny = config.vision_config, TINY[family]
    assert config.model_type == family
    assert type(AutoProcessor.from_pretrained(model_dir)).__name__ == tiny["processor"]
    assert (vision.hidden_size, vision.out_hidden_size, vision.depth, vision.patch_size) == (128, 256, 2,
                                                                                            tiny["patch"])
    assert {k: _plain(getattr(vision, k)) for k in tiny["vision"]} == tiny["vision"]
    assert read_marker(model_dir)["name"] == MODEL_NAMES[family]


def test_tokens_equal_the_full_models_own_vision_path(family, model_dir, encoder, images):
    full = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    image_processor = AutoProcessor.from_pretrained(model_dir).image_processor
    for image, encoded in zip(images, encoder.encode(images), strict=True):
        batch = image_processor(images=[image], return_tensors="pt")
        with torch.inference_mode():
            out = full.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
        # vLLM's image_embeds layout: merged tokens, then each deepstack level (Qwen3-VL), along the width.
        expected = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=1)
        assert torch.equal(encoded.grid_thw, batch["image_grid_thw"])
        assert encoded.image_tokens.shape[1] == TINY[family]["width"]
        torch.testing.assert_close(encoded.image_tokens, expected, rtol=0, atol=1e-5)
        assert encoder.num_tokens_for(image) == encoded.num_tokens


def _visual_keys(model_dir: Path) -> dict[str, str]:
    """Checkpoint key -> name relative to the tower, for the tower's keys."""
    keys = load_file(model_dir / "model.safetensors")
    prefix = next(p for p in ("model.visual.", "visual.") if any(k.startswith(p) for k in keys))
    return {k: k.removeprefix(prefix) for k in keys if k.startswith(prefix)}


def test_the_encoder_holds_exactly_the_checkpoints_vision_tensors(model_dir, encoder):
    visual = set(_visual_keys(model_dir).values())
    assert visual and {name for name, _ in encoder.tower.named_parameters()} == visual


def _nudged(model_dir: Path, dst: Path, pick) -> Path:
    def nudge(tensors):
        names = [k for k in tensors if pick(k)]
        assert names
        for name in names:
            tensors[name] += 1e-3

    return copy_checkpoint(model_dir, dst, nudge)


def test_version_changes_with_a_vision_weight(model_dir, encoder, tmp_path):
    merger_bias = max(k for k, rel in _visual_keys(model_dir).items() if rel.startswith("merger.") and
                      rel.endswith("bias"))
    copy = _nudged(model_dir, tmp_path / "other-vision", lambda k: k == merger_bias)
    assert VisionEncoder(copy, POLICY).version != encoder.version


def test_version_ignores_language_model_weights(model_dir, encoder, tmp_path):
    visual = _visual_keys(model_dir)
    copy = _nudged(model_dir, tmp_path / "other-llm",
                   lambda k: k not in visual and (k == "lm_head.weight" or "layers.0.mlp.up_proj" in k))
    assert VisionEncoder(copy, POLICY).version == encoder.version


def test_version_changes_with_a_config_field_that_changes_the_tokens(family, model_dir, encoder, images, tmp_path):
    copy = copy_checkpoint(model_dir, tmp_path / "other-vision-config")
    config = json.loads((copy / "config.json").read_text())
    config["vision_config"].update(TINY[family]["token_changing_edit"])
    (copy / "config.json").write_text(json.dumps(config))
    edited = VisionEncoder(copy, POLICY)
    assert edited.version != encoder.version  # same tensors, other tokens
    (a,), (b,) = edited.encode(images[:1]), encoder.encode(images[:1])
    assert not torch.allclose(a.image_tokens, b.image_tokens)


def test_cli_builds_the_family(family, model_dir, tmp_path):
    out = tmp_path / "cli"
    result = CliRunner().invoke(app, ["model", "tiny", "--out", str(out), "--family", family])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_cli_refuses_a_family_without_a_tiny_model(tmp_path):
    refused = CliRunner().invoke(app, ["model", "tiny", "--out", str(tmp_path / "x"), "--family", "llava"])
    unboxed = re.sub(r"[\s│╭╮╰╯─]+", "", refused.output)  # typer draws usage errors in a wrapped box
    assert refused.exit_code == 2 and "'llava'hasnotinymodel;useoneofqwen2_vl,qwen2_5_vl,qwen3_vl" in unboxed
    assert not (tmp_path / "x").exists()


# --- vLLM with each family's tiny model (one engine per family, one at a time) ------------------------------


@pytest.fixture(scope="module")
def store(family, tmp_path_factory) -> DiskFeatureStore:
    return DiskFeatureStore(tmp_path_factory.mktemp(f"{family}-features"))


@pytest.fixture(scope="module")
def keys(store, encoder, images) -> list[ImageKey]:
    """Two pages' image tokens stored as ingestion stores them: a 448-pixel square, a 500x300 page."""
    out = []
    for i, encoded in enumerate(encoder.encode(images[:2])):
        key = encoder.key_for(ContentHash(f"{i:02x}" * 32))
        store.put(key, encoded)
        out.append(key)
    return out


@pytest.fixture(scope="module")
async def engine(family, model_dir, store):
    """The family's tiny model in one in-process vLLM, fp32, with the session engine's settings."""
    config = EngineConfig(block_size=BLOCK, kv_cache_gib=1, max_model_len=2048, max_images_per_prompt=2,
                          enforce_eager=True, dtype="float32", max_num_seqs=4)
    started = time.perf_counter()
    # No vLLM metrics: they would replace the session engine's `vllm:*` series that later tests read.
    eng = InProcessEngine.start(ModelSource(model_dir, MODEL_NAMES[family], True), FeatureProvider.unscoped(store),
                                config, metrics=False)
    print(f"\n{family} engine started in {time.perf_counter() - started:.1f} s")
    yield eng
    await eng.close()


def _plan(*keys) -> PromptPlan:
    return PromptPlan(images=keys, text="What does this page show?", sampling=GREEDY)


async def _tokens(eng: InProcessEngine, request: dict) -> list[int]:
    tokens: list[int] = []
    async for out in eng.llm.generate(request, sampling_params(_plan()), request_id=uuid.uuid4().hex):
        tokens.extend(out.outputs[0].token_ids)
    return tokens


@pytest.mark.parametrize("index", [0, 1])  # the 500x300 page is not a whole number of windows / merges
async def test_image_embeds_give_the_same_tokens_as_pixels_given_to_vllm(engine, keys, encoder, images, index):
    key = keys[index]
    prompt = engine.renderer.render(_plan(key))
    (encoded,) = await engine.features.load([key])
    await engine.reset_prefix_cache()
    ours = await _tokens(engine, {  # fresh uuids: no cache can hit
        "prompt": prompt,
        "multi_modal_data": {"image": encoder.family.vllm_image_item([encoded])},
        "multi_modal_uuids": {"image": [f"embeds-{uuid.uuid4().hex}"]},
    })
    pixels = await _tokens(engine, {
        "prompt": prompt,
        "multi_modal_data": {"image": images[index]},
        "multi_modal_uuids": {"image": [f"pixels-{uuid.uuid4().hex}"]},
    })
    assert len(ours) == GREEDY.max_tokens and ours == pixels


async def test_a_prefix_hit_gives_the_cold_paths_greedy_tokens(engine, keys):
    await engine.reset_prefix_cache()
    cold = await engine.generate(_plan(keys[0]))
    hit = await engine.generate(_plan(keys[0]))
    assert cold.usage.cached_image_tokens == 0
    assert hit.usage.cached_image_tokens >= hit.usage.image_tokens // BLOCK * BLOCK - BLOCK > 0
    assert hit.token_ids == cold.token_ids and len(cold.token_ids) == GREEDY.max_tokens


async def test_the_pixels_form_gives_the_embeds_forms_greedy_tokens_cold_and_cached(engine, keys, images, store,
                                                                                    tmp_path):
    """MMRAG_IMAGE_INPUT=pixels (serving/engine/images.py): the stored pixels, resized by vLLM under the key's
    policy and encoded by vLLM's own encoder, under the key as uuid; the same tokens and token counts as the
    stored image tokens, cold and from the prefix cache (the 500x300 page too: another grid)."""
    with_pixels = DiskFeatureStore(tmp_path)
    for key, image in zip(keys, images, strict=False):
        with_pixels.put(key, dataclasses.replace(store.get(key), pixels_png=png_bytes(image)))
    pixels = engine.with_image_input(ImageInput.PIXELS)
    pixels.features = FeatureProvider.unscoped(with_pixels)
    await engine.reset_prefix_cache()
    embeds = [await engine.generate(_plan(k)) for k in keys]
    await engine.reset_prefix_cache()
    for key, want in zip(keys, embeds, strict=True):
        cold = await pixels.generate(_plan(key))
        hit = await pixels.generate(_plan(key))
        assert cold.usage.image_input == "pixels" and cold.usage.image_tokens == want.usage.image_tokens
        assert cold.token_ids == want.token_ids == hit.token_ids and len(cold.token_ids) == GREEDY.max_tokens
        assert cold.usage.cached_image_tokens == 0 and cold.usage.vision_encodes == 1
        assert hit.usage.cached_image_tokens >= hit.usage.image_tokens // BLOCK * BLOCK - BLOCK > 0


async def test_the_greedy_tokens_depend_on_the_image(engine, keys):
    # Otherwise the equalities above would hold for any image tokens at all.
    await engine.reset_prefix_cache()
    first, second = [(await engine.generate(_plan(k))).token_ids for k in keys]
    assert first != second


def _plain(value):
    return list(value) if isinstance(value, tuple) else value
