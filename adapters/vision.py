"""The vision service: turns page images into the VLM's image tokens ahead of time.

Only the vision tower and its projector (the "merger") of a Qwen2-VL checkpoint are loaded, never the
language model, so ingestion can run on machines that could not hold the LLM. Its output is exactly what
the VLM's own vision path computes; vLLM takes it as ``image_embeds`` + ``image_grid_thw`` and skips its
encoder. The :class:`EncoderVersion` names the weights, the processor config and the salt that produced
the tokens, so cached tokens are never reused across encoders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoConfig, AutoImageProcessor
from transformers.initialization import no_init_weights
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from adapters.checkpoint import local_checkpoint
from core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy
from core.pages import EncodedImage

log = logging.getLogger(__name__)

# transformers 5 names the tower "model.visual.*"; checkpoints saved by transformers 4 (all released
# Qwen2-VL models) and by transformers 5's save_pretrained use "visual.*".
VISUAL_PREFIXES = ("model.visual.", "visual.")
_SUPPORTED_MODEL_TYPES = ("qwen2_vl",)
_VERSION_HEX = 16


class VisionEncoder:
    """Vision tower + merger of a Qwen2-VL checkpoint, with the processor resized by a policy."""

    def __init__(
        self,
        model_path: str | Path,
        policy: ResolutionPolicy,
        *,
        salt: str = "",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        started = time.perf_counter()
        self.model_dir = local_checkpoint(model_path)
        self.policy = policy
        self.dtype = dtype
        self.forwards = 0  # images run through the tower; the metrics layer reads it

        config = AutoConfig.from_pretrained(self.model_dir)
        _check_model_type(config, self.model_dir)
        self.hidden_size: int = config.text_config.hidden_size
        self._merge: int = config.vision_config.spatial_merge_size

        state = load_visual_state(self.model_dir)
        processor_config = read_image_processor_config(self.model_dir)
        self.version = encoder_version(state, processor_config, salt=salt, dtype=dtype)
        self._processor = _build_processor(self.model_dir, policy, config.vision_config)
        # The tower + merger module, public for inspection (tests check it holds no LLM weights).
        self.tower = _build_visual(config.vision_config, state, dtype)
        device = next(self.tower.parameters()).device
        log.info("vision encoder loaded in %.1f s: version %s, policy %s, %s on %s, from %s",
                 time.perf_counter() - started, self.version, policy, str(dtype).removeprefix("torch."), device,
                 self.model_dir)

    def key_for(self, content_hash: ContentHash) -> ImageKey:
        return ImageKey(content_hash, self.version, self.policy)

    def num_tokens_for(self, image: Image.Image) -> int:
        """Image tokens ``image`` will take under this policy, from the resize rule alone (no forward)."""
        width, height = image.size
        return self._processor.get_number_of_image_patches(height, width) // self._merge**2

    def encode(self, images: list[Image.Image]) -> list[EncodedImage]:
        """One batched forward over all ``images``; the output is split back per image."""
        if not images:
            return []
        with torch.inference_mode():
            batch = self._processor(images=images, return_tensors="pt")
            grid = batch["image_grid_thw"]
            merged = self.tower(batch["pixel_values"].to(self.dtype), grid_thw=grid).pooler_output
        self.forwards += len(images)
        sizes = (grid.prod(-1) // self._merge**2).tolist()
        # clone(): a split is a view into the whole batch (saving it would write every image), and cloning
        # outside inference mode gives ordinary tensors that callers may modify.
        return [
            EncodedImage(tokens.clone(), thw.reshape(1, 3).clone())
            for tokens, thw in zip(torch.split(merged, sizes), grid, strict=True)
        ]


def visual_weight_files(model_dir: Path) -> tuple[str, dict[str, Path]]:
    """The tower's key prefix, and checkpoint key -> safetensors file for the tower's keys only.

    Reads the index or the safetensors header, never a tensor: finding the tower costs nothing even in a
    multi-GB sharded checkpoint, and shards holding only LLM weights are never opened afterwards.
    """
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        key_files = {key: model_dir / name for key, name in weight_map.items()}
    elif single.is_file():
        with safe_open(single, framework="pt") as f:
            key_files = {key: single for key in f.keys()}
    else:
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {model_dir}; the vision service reads "
            f"safetensors checkpoints only (re-save a .bin checkpoint with save_pretrained)"
        )
    prefix = _visual_prefix(key_files, model_dir)
    return prefix, {key: file for key, file in key_files.items() if key.startswith(prefix)}


def load_visual_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """The vision tower's tensors, named relative to the tower ("blocks.0.attn.qkv.weight"), as stored."""
    prefix, files = visual_weight_files(model_dir)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key, file in files.items():
        by_file[file].append(key)
    state: dict[str, torch.Tensor] = {}
    for file, keys in sorted(by_file.items()):
        with safe_open(file, framework="pt") as f:
            for key in keys:
                state[key.removeprefix(prefix)] = f.get_tensor(key)
    return state


def read_image_processor_config(model_dir: Path) -> dict[str, Any]:
    """The image processor's saved config, found where transformers 5 looks for it: the ``image_processor``
    section of processor_config.json (its own save_pretrained) first, else preprocessor_config.json (the
    released Qwen2-VL models). The same order keeps the hashed config the one actually loaded."""
    combined = model_dir / "processor_config.json"
    if combined.is_file():
        section = json.loads(combined.read_text(encoding="utf-8")).get("image_processor")
        if isinstance(section, dict):
            return section
    legacy = model_dir / "preprocessor_config.json"
    if legacy.is_file():
        return json.loads(legacy.read_text(encoding="utf-8"))
    raise FileNotFoundError(
        f"no image processor config in {model_dir} (processor_config.json with an image_processor section, "
        f"or preprocessor_config.json); save the checkpoint's processor there with save_pretrained"
    )


def encoder_version(
    visual_state: dict[str, torch.Tensor],
    processor_config: dict[str, Any],
    *,
    salt: str,
    dtype: torch.dtype,
) -> EncoderVersion:
    """sha256 over the tower's tensors (name, dtype, shape, bytes), the processor config, salt and dtype.

    The compute dtype is included because fp32 and bf16 towers give different tokens for the same image.
    Only the tower is hashed: hashing a multi-GB LLM on every start would cost more than loading the tower.
    """
    h = hashlib.sha256(b"mmrag-vision-encoder-v1\n")
    for name in sorted(visual_state):
        tensor = visual_state[name].contiguous()
        h.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}\n".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy())
    h.update(json.dumps(processor_config, sort_keys=True, separators=(",", ":")).encode())
    h.update(f"\nsalt={salt}\ndtype={dtype}\n".encode())
    return EncoderVersion(h.hexdigest()[:_VERSION_HEX])


def _visual_prefix(keys: dict[str, Path], model_dir: Path) -> str:
    found = [p for p in VISUAL_PREFIXES if any(k.startswith(p) for k in keys)]
    if len(found) != 1:
        raise ValueError(
            f"expected vision tower weights under exactly one of {VISUAL_PREFIXES} in {model_dir}, found "
            f"{found or 'none'}; is this a Qwen2-VL checkpoint?"
        )
    return found[0]


def _check_model_type(config: Any, model_dir: Path) -> None:
    if config.model_type not in _SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{model_dir} is a {config.model_type!r} model; the vision service supports {_SUPPORTED_MODEL_TYPES} "
            f"(set MMRAG_MODEL to a Qwen2-VL checkpoint)"
        )
    if config.vision_config.hidden_size != config.text_config.hidden_size:
        raise ValueError(
            f"{model_dir}: the vision merger outputs {config.vision_config.hidden_size} wide tokens but the "
            f"language model is {config.text_config.hidden_size} wide; the checkpoint's config is inconsistent"
        )


def _build_processor(model_dir: Path, policy: ResolutionPolicy, vision_config: Any):
    # The same class AutoProcessor (hence vLLM's pixel path) picks, so pixel and token inputs agree.
    processor = AutoImageProcessor.from_pretrained(
        model_dir, min_pixels=policy.min_pixels, max_pixels=policy.max_pixels
    )
    if (processor.patch_size, processor.merge_size) != (vision_config.patch_size, vision_config.spatial_merge_size):
        raise ValueError(
            f"{model_dir}: the image processor (patch {processor.patch_size}, merge {processor.merge_size}) does "
            f"not match the vision tower (patch {vision_config.patch_size}, merge "
            f"{vision_config.spatial_merge_size}); fix the checkpoint's processor config"
        )
    return processor


def _build_visual(vision_config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    # Skip the random init: every parameter is overwritten below (strict load), and init is slow for a
    # 600 M-parameter tower. Buffers such as the rotary inv_freq are still computed in __init__.
    with no_init_weights():
        visual = Qwen2VisionTransformerPretrainedModel._from_config(vision_config, dtype=dtype)
    visual.load_state_dict({name: t.to(dtype) for name, t in state.items()}, strict=True)
    return visual.eval().requires_grad_(False)
