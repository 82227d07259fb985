"""The tiny random-weight VLMs: deterministic, loadable offline, and honest about being random."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # any accidental hub lookup fails fast

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

from mmrag.adapters.checkpoint import MARKER_FILE, is_random_weight_model, read_marker
from mmrag.devkit.tiny_model import MODEL_NAME, MODEL_NAMES, build_tiny_model, ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(root / "a"), build_tiny_model(root / "b")


@pytest.fixture(scope="module")
def model_dir(built) -> Path:
    return built[0]


def _prompt(processor) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _noise(size: tuple[int, int], seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_building_twice_gives_byte_identical_weights_and_tokenizer(built):
    a, b = built
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_another_seed_changes_the_weights_but_not_the_tokenizer(built, tmp_path):
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (built[0] / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (built[0] / "tokenizer.json").read_bytes()


def test_processor_tokenizer_and_config_load_offline_with_auto_classes(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    assert config.model_type == "qwen2_vl"
    assert type(processor).__name__ == "Qwen2VLProcessor"
    for attr, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert getattr(config, attr) == tokenizer.convert_tokens_to_ids(token)
    text = config.text_config
    assert text.vocab_size % 64 == 0 and text.vocab_size >= len(tokenizer)
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        256,
        2,
        4,
        2,
    )
    assert text.rope_parameters["mrope_section"] == [8, 12, 12]
    vision = config.vision_config
    assert (vision.depth, vision.embed_dim, vision.hidden_size, vision.patch_size) == (2, 128, 256, 14)


def test_chat_template_puts_the_qwen_image_placeholder(model_dir):
    prompt = _prompt(AutoProcessor.from_pretrained(model_dir))
    assert f"<|im_start|>user\n{IMAGE_PART}What is shown?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_448_pixel_square_image_takes_256_image_tokens(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    batch = processor(text=[_prompt(processor)], images=[_noise((448, 448), 0)], return_tensors="pt")
    image_token_id = AutoConfig.from_pretrained(model_dir).image_token_id
    assert batch["image_grid_thw"].tolist() == [[1, 32, 32]]
    assert int((batch["input_ids"] == image_token_id).sum()) == 256


def test_greedy_output_depends_on_the_image(model_dir):
    # std 0.08 weights: with the default 0.02 every image would give the same greedy tokens.
    processor = AutoProcessor.from_pretrained(model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    outputs = []
    for seed in (0, 1):
        batch = processor(text=[_prompt(processor)], images=[_noise((224, 224), seed)], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=8, do_sample=False)
        outputs.append(out[0, batch["input_ids"].shape[1] :].tolist())
    assert outputs[0] != outputs[1]


def test_marker_says_the_weights_are_random(model_dir, tmp_path):
    marker = read_marker(model_dir)
    assert marker["name"] == MODEL_NAME and marker["random_weights"] is True and marker["seed"] == 0
    assert is_random_weight_model(model_dir)
    assert not is_random_weight_model(tmp_path)  # a folder without the marker: a real model
    assert not is_random_weight_model("Qwen/Qwen2-VL-2B-Instruct")  # a hub id is not a random model


def test_checking_the_marker_imports_neither_vllm_nor_torch(model_dir):
    code = (
        "import sys; from mmrag.adapters.checkpoint import is_random_weight_model; "
        f"assert is_random_weight_model({str(model_dir)!r}); "
        "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_building_into_an_existing_folder_is_refused(model_dir):
    with pytest.raises(FileExistsError, match="remove it"):
        build_tiny_model(model_dir)


def test_ensure_reuses_a_matching_build_and_refuses_a_different_one(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(FileExistsError, match="does not hold"):
        ensure_tiny_model(model_dir, seed=7)


def test_a_qwen2_5_vl_build_is_deterministic_and_shares_the_tokenizer(model_dir, tmp_path):
    a = build_tiny_model(tmp_path / "a", family="qwen2_5_vl")
    b = build_tiny_model(tmp_path / "b", family="qwen2_5_vl")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "processor_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert AutoConfig.from_pretrained(a).model_type == "qwen2_5_vl"
    assert read_marker(a)["name"] == MODEL_NAMES["qwen2_5_vl"] and read_marker(a)["spec"]["family"] == "qwen2_5_vl"


def test_a_family_without_a_tiny_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tiny models exist for qwen2_vl, qwen2_5_vl, qwen3_vl"):
        build_tiny_model(tmp_path / "llava", family="llava")
    assert not (tmp_path / "llava").exists()


def test_ensure_accepts_a_qwen2_vl_build_whose_marker_predates_families(model_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(model_dir, old)
    marker = json.loads((old / MARKER_FILE).read_text())
    del marker["spec"]["family"]
    (old / MARKER_FILE).write_text(json.dumps(marker))
    assert ensure_tiny_model(old) == old
    with pytest.raises(FileExistsError, match="does not hold"):
        ensure_tiny_model(old, family="qwen2_5_vl")


def test_a_larger_benchmark_variant_comes_from_parameters_alone(tmp_path):
    big = build_tiny_model(tmp_path / "big", hidden=512, layers=3, vision_depth=3)
    config = AutoConfig.from_pretrained(big)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        512,
        3,
        8,
        4,
    )
    assert (vision.depth, vision.hidden_size) == (3, 512)
    assert json.loads((big / MARKER_FILE).read_text())["spec"]["hidden"] == 512
