"""The vision service: the VLM's own image tokens, from the vision tower alone, under a versioned key."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # any accidental hub lookup fails fast

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

import mmrag.adapters.vision as vision
from mmrag.core.keys import ContentHash, ImageKey, ResolutionPolicy
from mmrag.adapters.checkpoint import ModelNotFoundError
from mmrag.devkit.tiny_model import build_tiny_model
from mmrag.adapters.vision import EncodedImage, VisionEncoder

POLICY = ResolutionPolicy(56 * 56, 448 * 448)
SIZES = [(448, 448), (500, 300), (60, 100)]  # (width, height): square, landscape, tiny portrait


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vision") / "tiny")


@pytest.fixture(scope="module")
def encoder(model_dir) -> VisionEncoder:
    return VisionEncoder(model_dir, POLICY)


def noise_images() -> list[Image.Image]:
    """One random-noise image per size in SIZES, the same on every call."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    return noise_images()


def copy_checkpoint(
    src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None] | None = None
) -> Path:
    """A copy of the checkpoint, with ``edit`` applied to its tensors (checkpoint names)."""
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_tokens_equal_the_full_models_own_vision_path(model_dir, encoder, images):
    full = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    image_processor = AutoProcessor.from_pretrained(model_dir).image_processor
    for image, encoded in zip(images, encoder.encode(images), strict=True):
        batch = image_processor(images=[image], return_tensors="pt")
        with torch.inference_mode():
            expected = full.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
        assert torch.equal(encoded.grid_thw, batch["image_grid_thw"])
        torch.testing.assert_close(encoded.image_tokens, expected, rtol=0, atol=1e-5)


def test_a_batch_of_different_sizes_equals_encoding_each_alone(encoder, images):
    batched = encoder.encode(images)
    for image, together in zip(images, batched, strict=True):
        (alone,) = encoder.encode([image])
        assert torch.equal(together.grid_thw, alone.grid_thw)
        torch.testing.assert_close(together.image_tokens, alone.image_tokens, rtol=0, atol=1e-5)


def test_encoded_image_is_what_vllm_takes_as_image_embeds(encoder, images):
    for image, encoded in zip(images, encoder.encode(images), strict=True):
        assert isinstance(encoded, EncodedImage)
        t, h, w = encoded.grid_thw[0].tolist()
        assert encoded.grid_thw.shape == (1, 3) and encoded.grid_thw.dtype == torch.int64
        assert encoded.image_tokens.shape == (t * h * w // 4, encoder.hidden_size) == (encoded.num_tokens, 256)
        assert encoded.image_tokens.dtype == torch.float32 and encoded.image_tokens.device.type == "cpu"
        assert encoded.image_tokens.is_contiguous() and not encoded.image_tokens.is_inference()
        # Owns its storage: saving one page's tokens must not write the whole batch.
        tokens = encoded.image_tokens
        assert tokens.untyped_storage().nbytes() == tokens.numel() * tokens.element_size()
        assert encoder.num_tokens_for(image) == encoded.num_tokens


def test_a_448_pixel_page_takes_256_tokens_without_a_forward(encoder, images):
    before = encoder.forwards
    assert encoder.num_tokens_for(images[0]) == 256
    assert encoder.forwards == before


def test_forwards_count_the_images_encoded(model_dir, images):
    fresh = VisionEncoder(model_dir, POLICY)
    fresh.encode(images)
    fresh.encode(images[:1])
    assert fresh.encode([]) == []
    assert fresh.forwards == len(images) + 1


def test_the_policy_sets_the_resolution(model_dir, images):
    small = VisionEncoder(model_dir, ResolutionPolicy(56 * 56, 224 * 224))
    (encoded,) = small.encode(images[:1])
    assert encoded.grid_thw.tolist() == [[1, 16, 16]] and encoded.num_tokens == 64


def test_encoder_reads_only_vision_tower_weights(model_dir, monkeypatch):
    read: list[str] = []

    class RecordingSafeOpen:
        def __init__(self, path, framework):
            self._handle = safe_open(path, framework=framework)

        def __enter__(self):
            self._file = self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def keys(self):
            return self._file.keys()

        def get_tensor(self, key):
            read.append(key)
            return self._file.get_tensor(key)

    monkeypatch.setattr(vision, "safe_open", RecordingSafeOpen)
    encoder = VisionEncoder(model_dir, POLICY)

    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        visual_keys = {k for k in f.keys() if k.startswith("visual.")}
    assert visual_keys and set(read) == visual_keys  # every tower tensor, and nothing else
    names = [name for name, _ in encoder.tower.named_parameters()]
    assert not any("language_model" in n or "lm_head" in n or "embed_tokens" in n for n in names)
    assert sorted(names) == sorted(k.removeprefix("visual.") for k in visual_keys)


def test_key_carries_the_encoder_version_and_policy(encoder):
    content = ContentHash("ab" * 32)
    key = encoder.key_for(content)
    assert key == ImageKey(content, encoder.version, POLICY)
    assert ImageKey.parse(str(key)) == key
    assert len(encoder.version) == 16


def test_the_qwen2_vl_version_before_preprocessing_was_covered_is_the_one_computed_before_the_family_registry(
        model_dir, encoder):
    # Pages ingested before the version covered preprocessing carry this version: `mmrag index check` recognises
    # them by it (an old key format), and `mmrag reencode` migrates them. (It also changes if transformers saves
    # another processor config for the tiny model.)
    assert vision.encoder_version_before_preprocessing_of(
        model_dir, salt="", dtype=torch.float32, device_kind="cpu") == "2ab6badb11c2f884"
    assert encoder.version != "2ab6badb11c2f884"  # the preprocessing now counts: every old key is an old one


@pytest.fixture
def fresh_preprocessing():
    """No fingerprint cached from another test's processor (a test here swaps the processor class)."""
    vision.checkpoint_preprocessing.cache_clear()
    yield
    vision.checkpoint_preprocessing.cache_clear()


class _Backend:
    """AutoImageProcessor picking ``backend`` as it would with torchvision importable (torchvision) or not (pil)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def from_pretrained(self, *args, **kwargs):
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(*args, backend=self.backend, **kwargs)


def _probe_pixels(processor) -> torch.Tensor:
    return processor(images=vision.probe_images(), return_tensors="pt")["pixel_values"]


def test_the_fast_and_the_slow_processor_give_different_versions_exactly_when_their_pixels_differ(
        model_dir, monkeypatch, fresh_preprocessing):
    pytest.importorskip("torchvision", reason="the fast (torchvision) processor needs torchvision; the rule is "
                        "still tested with a perturbed processor below")
    versions, pixels, classes = {}, {}, {}
    for backend in ("torchvision", "pil"):
        monkeypatch.setattr(vision, "AutoImageProcessor", _Backend(backend))
        vision.checkpoint_preprocessing.cache_clear()
        versions[backend] = vision.encoder_version_of(model_dir, salt="", dtype=torch.float32, device_kind="cpu")
        processor = vision._build_processor(model_dir, vision.PROBE_POLICY,
                                            VisionEncoder(model_dir, POLICY)._vision_config)
        classes[backend], pixels[backend] = type(processor).__name__, _probe_pixels(processor)
    assert classes["torchvision"] != classes["pil"]  # two implementations were built
    differ = not torch.equal(pixels["torchvision"], pixels["pil"])
    assert (versions["torchvision"] != versions["pil"]) == differ
    assert differ, "this transformers' fast and slow Qwen2-VL processors agree on the probes: no version split"


def test_the_preprocessing_fingerprint_changes_exactly_when_the_pixels_do(model_dir):
    """The rule without torchvision: the slow processor against itself, and against a copy of its class whose output
    is moved by one float32 step in one value (too small for anything but the bytes to notice)."""
    from transformers import AutoImageProcessor

    def build():
        return AutoImageProcessor.from_pretrained(model_dir, backend="pil", min_pixels=vision.PROBE_POLICY.min_pixels,
                                                  max_pixels=vision.PROBE_POLICY.max_pixels)

    base = build()

    class Nudged(type(base)):
        def __call__(self, *args, **kwargs):
            batch = super().__call__(*args, **kwargs)
            values = batch["pixel_values"]
            values.view(-1)[7] = torch.nextafter(values.view(-1)[7], torch.tensor(10.0))
            return batch

    Nudged.__name__ = type(base).__name__  # the same class name: only the pixels differ
    nudged = build()
    nudged.__class__ = Nudged
    assert not torch.equal(_probe_pixels(base), _probe_pixels(nudged))
    assert vision.preprocessing_fingerprint(base) == vision.preprocessing_fingerprint(build())
    assert vision.preprocessing_fingerprint(base) != vision.preprocessing_fingerprint(nudged)


def test_the_probe_images_are_fixed_and_are_resized_both_ways():
    first, again = vision.probe_images(), vision.probe_images()
    assert [im.tobytes() for im in first] == [im.tobytes() for im in again]
    areas = [im.width * im.height for im in first]
    assert min(areas) < vision.PROBE_POLICY.min_pixels and max(areas) > vision.PROBE_POLICY.max_pixels


def test_the_preprocessing_fingerprint_is_computed_once_per_checkpoint(model_dir, monkeypatch, fresh_preprocessing):
    calls = []
    real = vision.preprocessing_fingerprint
    monkeypatch.setattr(vision, "preprocessing_fingerprint", lambda p: calls.append(p) or real(p))
    first = VisionEncoder(model_dir, POLICY).version
    assert VisionEncoder(model_dir, POLICY, salt="x").version != first
    assert vision.encoder_version_of(model_dir, salt="", dtype=torch.float32, device_kind="cpu") == first
    assert len(calls) == 1


def test_version_is_stable_across_loads(model_dir, encoder):
    assert VisionEncoder(model_dir, POLICY).version == encoder.version


def test_version_changes_with_the_salt(model_dir, encoder):
    assert VisionEncoder(model_dir, POLICY, salt="ocr-v2").version != encoder.version


def test_version_changes_with_the_compute_dtype(model_dir, encoder):
    assert VisionEncoder(model_dir, POLICY, dtype=torch.bfloat16).version != encoder.version


def test_version_changes_with_the_image_processor_config(model_dir, encoder, tmp_path):
    copy = copy_checkpoint(model_dir, tmp_path / "other-processor")
    config = json.loads((copy / "processor_config.json").read_text())
    config["image_processor"]["image_mean"] = [0.5, 0.5, 0.5]
    (copy / "processor_config.json").write_text(json.dumps(config))
    assert VisionEncoder(copy, POLICY).version != encoder.version


def test_a_released_style_preprocessor_config_gives_the_same_version_and_tokens(
    model_dir, encoder, images, tmp_path
):
    # Released Qwen2-VL checkpoints keep the image processor in a flat preprocessor_config.json.
    copy = copy_checkpoint(model_dir, tmp_path / "released-layout")
    combined = json.loads((copy / "processor_config.json").read_text())
    (copy / "preprocessor_config.json").write_text(json.dumps(combined.pop("image_processor")))
    (copy / "processor_config.json").write_text(json.dumps(combined))

    released = VisionEncoder(copy, POLICY)
    assert released.version == encoder.version  # the same config content, wherever it is stored
    for a, b in zip(released.encode(images), encoder.encode(images), strict=True):
        assert torch.equal(a.image_tokens, b.image_tokens)


def test_version_changes_when_a_vision_weight_changes(model_dir, encoder, tmp_path):
    def nudge_merger(tensors):
        tensors["visual.merger.mlp.2.bias"] += 1e-3

    copy = copy_checkpoint(model_dir, tmp_path / "other-vision", nudge_merger)
    assert VisionEncoder(copy, POLICY).version != encoder.version


def test_version_ignores_language_model_weights(model_dir, encoder, tmp_path):
    def nudge_llm(tensors):
        tensors["lm_head.weight"] += 1e-3
        tensors["model.layers.0.mlp.up_proj.weight"] += 1e-3

    copy = copy_checkpoint(model_dir, tmp_path / "other-llm", nudge_llm)
    assert VisionEncoder(copy, POLICY).version == encoder.version


def test_sharded_checkpoint_with_transformers5_names_gives_the_same_tokens(model_dir, encoder, images, tmp_path):
    copy = copy_checkpoint(model_dir, tmp_path / "sharded")
    tensors = load_file(copy / "model.safetensors")
    (copy / "model.safetensors").unlink()
    renamed = {("model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():  # each shard holds part of the tower and part of the LLM
        save_file({k: renamed[k] for k in keys}, copy / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    sharded = VisionEncoder(copy, POLICY)
    assert sharded.version == encoder.version  # names are hashed relative to the tower
    for a, b in zip(sharded.encode(images), encoder.encode(images), strict=True):
        assert torch.equal(a.image_tokens, b.image_tokens)


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(model_dir, encoder, monkeypatch, tmp_path):
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--mmrag--tiny-qwen2vl"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    assert VisionEncoder("mmrag/tiny-qwen2vl", POLICY).version == encoder.version


def test_a_model_neither_local_nor_cached_names_the_fix():
    with pytest.raises(ModelNotFoundError, match="hf download nobody/no-such-model"):
        VisionEncoder("nobody/no-such-model", POLICY)
    with pytest.raises(ModelNotFoundError, match="model folder /no/such/folder does not exist"):
        VisionEncoder("/no/such/folder", POLICY)


def test_a_checkpoint_without_a_vision_tower_is_refused(model_dir, tmp_path):
    def drop_tower(tensors):
        for key in [k for k in tensors if k.startswith("visual.")]:
            del tensors[key]

    copy = copy_checkpoint(model_dir, tmp_path / "no-tower", drop_tower)
    with pytest.raises(ValueError, match="is this a Qwen2-VL checkpoint"):
        VisionEncoder(copy, POLICY)
