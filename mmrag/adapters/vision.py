"""The vision service: turns page images into the VLM's image tokens ahead of time.

Only the vision tower and its projector (the "merger") of a supported checkpoint are loaded (the family
registry, ``mmrag/adapters/families.py``, says how for each family), never the language model, so ingestion can run
on machines that could not hold the LLM. Its output is exactly what the VLM's own vision path computes; vLLM
takes it as ``image_embeds`` + ``image_grid_thw`` and skips its encoder. The :class:`EncoderVersion` names the
weights, the processor config, the preprocessing implementation and the salt that produced the tokens, so cached
tokens are never reused across encoders.

A pooled policy (``ResolutionPolicy.pool`` 2) averages each 2x2 square of merged tokens after the projector
(:func:`pool_grid`): a quarter of the tokens, still a grid, whose ``image_grid_thw`` (t, h/2, w/2) gives vLLM
the token count (t*h*w / merge²) and the M-RoPE positions of that grid. The page is resized to a multiple of
patch * merge * pool so the merged grid divides evenly. Merging arbitrary tokens (ToMe) is left out: its
merged tokens form no grid, and M-RoPE can only position the rows and columns of one.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoConfig, AutoImageProcessor
from transformers.initialization import no_init_weights
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from mmrag.adapters.checkpoint import local_checkpoint
from mmrag.adapters.families import VisionFamily, family_for
from mmrag.adapters.vision_client import png_bytes  # lossless: the pixels form decodes the very pixels encoded
from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy
from mmrag.core.pages import EncodedImage

log = logging.getLogger(__name__)

_VERSION_HEX = 16


class VisionEncoder:
    """Vision tower + merger of a supported VLM checkpoint, with the processor resized by a policy."""

    def __init__(
        self,
        model_path: str | Path,
        policy: ResolutionPolicy,
        *,
        salt: str = "",
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        keep_pixels: bool = False,
        tokens: bool = True,
    ) -> None:
        """``keep_pixels``: each encoded image also carries its pixels (lossless PNG) for an engine that encodes
        them itself (MMRAG_IMAGE_INPUT=pixels). ``tokens`` False (that form only, MMRAG_INGEST_IMAGE_TOKENS=false):
        no forward; the entry keeps the grid and token count the processor's resize rule gives, and no tokens."""
        if not tokens and not keep_pixels:
            raise ValueError("an encoder that makes no tokens must keep the pixels: set MMRAG_IMAGE_INPUT=pixels "
                             "with MMRAG_INGEST_IMAGE_TOKENS=false, or leave the tokens on")
        started = time.perf_counter()
        self._pixels_form = (keep_pixels, tokens)
        self.keep_pixels, self.makes_tokens = self._form_under(policy)
        checkpoint = VisionCheckpoint.load(model_path)
        self.model_dir = checkpoint.model_dir
        self.family = checkpoint.family
        self.policy = policy
        self.dtype = dtype
        self.device = torch.device(device)
        self.forwards = 0  # images run through the tower; the metrics layer reads it

        self._vision_config = vision_config = checkpoint.config.vision_config
        self.hidden_size: int = checkpoint.config.text_config.hidden_size
        self._merge: int = vision_config.spatial_merge_size
        self.version = checkpoint.version(salt=salt, dtype=dtype, device_kind=self.device.type)
        self._processor = _build_processor(self.model_dir, policy, vision_config)
        # The tower + merger module, public for inspection (tests check it holds no LLM weights).
        self.tower = _build_visual(self.family, vision_config, checkpoint.state, dtype).to(self.device)
        log.info("vision encoder loaded in %.1f s: %s, version %s, policy %s, %s on %s, from %s",
                 time.perf_counter() - started, self.family.label, self.version, policy,
                 str(dtype).removeprefix("torch."), self.device, self.model_dir)

    def key_for(self, content_hash: ContentHash) -> ImageKey:
        return ImageKey(content_hash, self.version, self.policy)

    def view(self) -> VisionEncoder:
        """This encoder with a forward count of its own, for a caller that counts its forwards (question images)
        while others (ingestion, tiers) run the same tower: the weights are not copied."""
        other = copy.copy(self)
        other.forwards = 0
        return other

    def with_policy(self, policy: ResolutionPolicy) -> VisionEncoder:
        """This encoder under another policy (a resolution tier): the same tower and version, no weights loaded
        again; its own processor and forward count."""
        if policy == self.policy:
            return self
        other = copy.copy(self)
        other.policy = policy
        other.keep_pixels, other.makes_tokens = self._form_under(policy)
        other._processor = _build_processor(self.model_dir, policy, self._vision_config)
        other.forwards = 0
        return other

    def _form_under(self, policy: ResolutionPolicy) -> tuple[bool, bool]:
        """(keep_pixels, makes_tokens) under ``policy``: a pooled policy's tokens are averaged after the projector,
        which vLLM's own encoder does not do, so its entries are always tokens (serving/engine/images.py sends
        them as image_embeds)."""
        return (False, True) if policy.pooled else self._pixels_form

    def num_tokens_for(self, image: Image.Image) -> int:
        """Image tokens ``image`` will take under this policy, from the resize rule alone (no forward)."""
        width, height = image.size
        if not self.policy.pooled:
            return self.family.num_tokens(self._processor, self._merge, width, height)
        h, w = self._pooled_size(height, width)
        return (h // self._patch) * (w // self._patch) // (self._merge * self.policy.pool) ** 2

    def encode(self, images: list[Image.Image]) -> list[EncodedImage]:
        """One batched forward over all ``images``; the output is split back per image (and pooled, when the
        policy says so)."""
        if not images:
            return []
        if self.policy.pooled:
            # Sides in multiples of patch * merge * pool: the processor keeps them (they are multiples of its own
            # factor, within its bounds), and every merged-token row and column has a pooling partner.
            images = [im.resize(self._pooled_size(im.height, im.width)[::-1], Image.Resampling.BICUBIC)
                      for im in images]
        pngs = [png_bytes(im) if self.keep_pixels else None for im in images]
        with torch.inference_mode():
            batch = self._processor(images=images, return_tensors="pt")
            grid = batch["image_grid_thw"]
            sizes = (grid.prod(-1) // self._merge**2).tolist()
            if not self.makes_tokens:  # the pixels form without tokens: the resize rule's grid, no forward
                return [EncodedImage(torch.zeros(n, 0, dtype=self.dtype), thw.reshape(1, 3).clone(), png)
                        for n, thw, png in zip(sizes, grid, pngs, strict=True)]
            pixels = batch["pixel_values"].to(self.device, self.dtype)
            # Back on the CPU: the store writes, and vLLM takes, host tensors.
            merged = self.family.image_embeds(self.tower(pixels, grid_thw=grid.to(self.device))).cpu()
        self.forwards += len(images)
        # clone(): a split is a view into the whole batch (saving it would write every image), and cloning
        # outside inference mode gives ordinary tensors that callers may modify.
        out = [
            EncodedImage(tokens.clone(), thw.reshape(1, 3).clone(), png)
            for tokens, thw, png in zip(torch.split(merged, sizes), grid, pngs, strict=True)
        ]
        return [pool_grid(e, self._merge, self.policy.pool) for e in out] if self.policy.pooled else out

    @property
    def _patch(self) -> int:
        return int(self._processor.patch_size)

    def _pooled_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) a page is resized to under a pooled policy."""
        return smart_resize(height, width, factor=self._patch * self._merge * self.policy.pool,
                            min_pixels=self.policy.min_pixels, max_pixels=self.policy.max_pixels)


def pool_grid(image: EncodedImage, merge: int, pool: int) -> EncodedImage:
    """Average each ``pool`` x ``pool`` square of the merged-token grid into one token, in the grid's row-major
    order (the order the merger emits and vLLM's M-RoPE positions): the grid_thw becomes (t, h/pool, w/pool)
    patches, so vLLM's count t*h*w / merge² is the pooled token count. The mean is taken in fp32."""
    t, h, w = (int(v) for v in image.grid_thw.reshape(3))
    rows, cols = h // merge, w // merge
    if rows % pool or cols % pool:
        raise ValueError(f"a {rows}x{cols} merged-token grid does not pool {pool}x{pool}: resize the page to a "
                         f"multiple of patch * merge * {pool} first")
    tokens = image.image_tokens
    squares = tokens.float().reshape(t, rows // pool, pool, cols // pool, pool, tokens.shape[-1])
    pooled = squares.mean(dim=(2, 4)).reshape(-1, tokens.shape[-1]).to(tokens.dtype).contiguous()
    return EncodedImage(pooled, torch.tensor([[t, h // pool, w // pool]], dtype=image.grid_thw.dtype))


@dataclass(frozen=True, slots=True)
class VisionCheckpoint:
    """What of a checkpoint the vision service reads: its config, family, the tower's tensors as stored and
    the image processor's config. Enough to compute the encoder version without building the tower."""

    model_dir: Path
    config: Any
    family: VisionFamily
    state: dict[str, torch.Tensor]
    processor_config: dict[str, Any]

    @classmethod
    def load(cls, model_path: str | Path) -> VisionCheckpoint:
        model_dir = local_checkpoint(model_path)
        config = AutoConfig.from_pretrained(model_dir)
        family = _checked_family(config, model_dir)
        return cls(model_dir, config, family, load_visual_state(model_dir, family),
                   read_image_processor_config(model_dir))

    def version(self, *, salt: str, dtype: torch.dtype, device_kind: str) -> EncoderVersion:
        return self.versions(salt=salt, dtype=dtype, device_kind=device_kind)[0]

    def version_before_preprocessing(self, *, salt: str, dtype: torch.dtype, device_kind: str) -> EncoderVersion:
        """The version this encoder had before versions covered the preprocessing implementation: the one pages
        ingested then carry, by which `mmrag index check` names them old (`mmrag reencode` migrates them)."""
        return self.versions(salt=salt, dtype=dtype, device_kind=device_kind)[1]

    def versions(self, *, salt: str, dtype: torch.dtype, device_kind: str) -> tuple[EncoderVersion, EncoderVersion]:
        """(today's version, the one before it covered preprocessing), from one pass over the tower's tensors."""
        preprocessing = checkpoint_preprocessing(self.model_dir, _canonical(self.processor_config))
        return encoder_versions(self.state, self.processor_config, salt=salt, dtype=dtype, device_kind=device_kind,
                                family_config=self.family.versioned_config(self.config.vision_config),
                                preprocessing=preprocessing)


def encoder_versions_of(model_path: str | Path, *, salt: str, dtype: torch.dtype, device_kind: str
                        ) -> tuple[EncoderVersion, EncoderVersion]:
    """The version a :class:`VisionEncoder` with these arguments would have, and the one before it covered
    preprocessing, without building the tower (an API host computes the version of pages encoded on a GPU host
    without needing that GPU). One load and one hash of the tower for both."""
    return VisionCheckpoint.load(model_path).versions(salt=salt, dtype=dtype, device_kind=device_kind)


def encoder_version_of(model_path: str | Path, *, salt: str, dtype: torch.dtype, device_kind: str) -> EncoderVersion:
    """Today's version of :func:`encoder_versions_of`."""
    return encoder_versions_of(model_path, salt=salt, dtype=dtype, device_kind=device_kind)[0]


def encoder_version_before_preprocessing_of(model_path: str | Path, *, salt: str, dtype: torch.dtype,
                                            device_kind: str) -> EncoderVersion:
    """The version before it covered preprocessing, of :func:`encoder_versions_of`: the one a checkpoint's pages
    carry when an mmrag from before then ingested them."""
    return encoder_versions_of(model_path, salt=salt, dtype=dtype, device_kind=device_kind)[1]


# The preprocessing fingerprint's fixed inputs. One probe policy for every encoder policy: the version is shared by
# all tiers of one tower (a tier's key differs in its policy only, mmrag/core/keys.py Tiers), and the policy is in the
# key already; what the probes must expose is the implementation. The sizes make the processor upscale one probe
# to min_pixels, downscale one to max_pixels and resize one within the bounds, each to another aspect ratio, so
# that resampling, antialiasing, rounding and normalisation all move some value.
PROBE_POLICY = ResolutionPolicy(56 * 56, 112 * 112)
_PROBE_SIZES = ((37, 23), (203, 131), (90, 61))  # (width, height)


def probe_images() -> list[Image.Image]:
    """The probe images: a texture with edges at every scale, from integer arithmetic alone (no file, no download,
    no random generator whose stream could change with numpy), so every host and version makes the same bytes."""
    images = []
    for width, height in _PROBE_SIZES:
        y, x = np.mgrid[0:height, 0:width]
        channels = [(x * (7 + c) + y * (13 - c) + (x * y) % (17 + 2 * c) * 11 + (x // 5 + y // 3) % 2 * 97) % 256
                    for c in range(3)]
        images.append(Image.fromarray(np.stack(channels, axis=-1).astype(np.uint8), "RGB"))
    return images


def preprocessing_fingerprint(processor: Any) -> str:
    """What of the image processor changes tokens beyond its config: its class, and the pixel values and grids it
    makes of the probe images, as exact float32 bytes.

    ``AutoImageProcessor`` picks the torchvision ("fast") or the PIL ("slow") implementation of one class by whether
    torchvision imports, and a transformers upgrade may change resizing; either puts other pixels, hence other
    tokens, under the same weights and config. The class enters without its backend suffix: the backend's effect
    is in the pixels, so two hosts whose backends make the same pixels share a version, and any pixel that
    differs splits it. The bytes are exact rather than rounded: rounding each of thousands of values still flips
    those that sit near a rounding boundary, so it would not make hosts whose arithmetic differs agree; it would
    only let small differences in resizing pass unseen.
    """
    batch = processor(images=probe_images(), return_tensors="pt")
    pixels = torch.as_tensor(batch["pixel_values"]).to(torch.float32).contiguous()
    h = hashlib.sha256(f"{list(pixels.shape)}|{torch.as_tensor(batch['image_grid_thw']).tolist()}\n".encode())
    h.update(pixels.reshape(-1).view(torch.uint8).numpy())
    return f"{_processor_class(processor)}:{h.hexdigest()}"


@functools.lru_cache(maxsize=16)
def checkpoint_preprocessing(model_dir: Path, processor_config: str) -> str:
    """:func:`preprocessing_fingerprint` of the processor the checkpoint loads (under :data:`PROBE_POLICY`), once
    per process for a checkpoint and config (``processor_config``: its canonical JSON, part of the cache key so
    an edited config is fingerprinted again): a few small images through the processor at start-up, then free."""
    return preprocessing_fingerprint(_auto_processor(model_dir, PROBE_POLICY))


def visual_weight_files(model_dir: Path, family: VisionFamily) -> tuple[str, dict[str, Path]]:
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
    prefix = _visual_prefix(key_files, model_dir, family)
    return prefix, {key: file for key, file in key_files.items() if key.startswith(prefix)}


def load_visual_state(model_dir: Path, family: VisionFamily) -> dict[str, torch.Tensor]:
    """The vision tower's tensors, named relative to the tower ("blocks.0.attn.qkv.weight"), as stored."""
    prefix, files = visual_weight_files(model_dir, family)
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
    family_config: dict[str, Any],
    device_kind: str = "cpu",
    preprocessing: str | None,
) -> EncoderVersion:
    """sha256 over the tower's tensors (name, dtype, shape, bytes), the processor config, salt, compute
    dtype and device kind, the family's token-changing vision config fields (``family_config``) and the
    preprocessing implementation (``preprocessing``: :func:`preprocessing_fingerprint`).

    The compute dtype and the device kind are included because fp32 and bf16 towers, or CPU and GPU kernels,
    give different tokens for the same image (mmrag/adapters/hardware.py VisionPlacement). The CPU adds no bytes,
    so CPU versions are the ones computed before the device was configurable.
    Only the tower is hashed: hashing a multi-GB LLM on every start would cost more than loading the tower.
    An empty ``family_config`` (Qwen2-VL) adds no bytes, so Qwen2-VL versions, hence indexed keys, are the
    ones computed before the family registry existed. ``preprocessing`` None adds no bytes either: that is the
    version as computed before it covered preprocessing, kept only to recognise pages keyed by it.
    """
    h = _version_hash(visual_state, processor_config, salt=salt, dtype=dtype, family_config=family_config,
                      device_kind=device_kind)
    if preprocessing is not None:
        h.update(f"\npreprocessing={preprocessing}\n".encode())
    return EncoderVersion(h.hexdigest()[:_VERSION_HEX])


def encoder_versions(visual_state: dict[str, torch.Tensor], processor_config: dict[str, Any], *, salt: str,
                     dtype: torch.dtype, family_config: dict[str, Any], device_kind: str = "cpu",
                     preprocessing: str) -> tuple[EncoderVersion, EncoderVersion]:
    """:func:`encoder_version` with ``preprocessing`` and without it, from one pass over the tensors (the
    preprocessing bytes come last, so both hashes share everything before them)."""
    h = _version_hash(visual_state, processor_config, salt=salt, dtype=dtype, family_config=family_config,
                      device_kind=device_kind)
    before = EncoderVersion(h.hexdigest()[:_VERSION_HEX])
    h.update(f"\npreprocessing={preprocessing}\n".encode())
    return EncoderVersion(h.hexdigest()[:_VERSION_HEX]), before


def _version_hash(visual_state: dict[str, torch.Tensor], processor_config: dict[str, Any], *, salt: str,
                  dtype: torch.dtype, family_config: dict[str, Any], device_kind: str) -> Any:
    """The version's hash over everything but the preprocessing fingerprint (encoder_version's docstring)."""
    h = hashlib.sha256(b"mmrag-vision-encoder-v1\n")
    for name in sorted(visual_state):
        tensor = visual_state[name].contiguous()
        h.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}\n".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy())
    h.update(_canonical(processor_config).encode())
    h.update(f"\nsalt={salt}\ndtype={dtype}\n".encode())
    if family_config:
        h.update(json.dumps(family_config, sort_keys=True, separators=(",", ":")).encode())
    if device_kind != "cpu":
        h.update(f"\ndevice={device_kind}\n".encode())
    return h


def _visual_prefix(keys: dict[str, Path], model_dir: Path, family: VisionFamily) -> str:
    found = [p for p in family.visual_prefixes if any(k.startswith(p) for k in keys)]
    if len(found) != 1:
        raise ValueError(
            f"expected vision tower weights under exactly one of {family.visual_prefixes} in {model_dir}, "
            f"found {found or 'none'}; is this a {family.label} checkpoint?"
        )
    return found[0]


def _checked_family(config: Any, model_dir: Path) -> VisionFamily:
    family = family_for(config.model_type, model_dir)
    width = family.out_width(config.vision_config)
    if width != config.text_config.hidden_size:
        raise ValueError(
            f"{model_dir}: the vision merger outputs {width} wide tokens but the language model is "
            f"{config.text_config.hidden_size} wide; the checkpoint's config is inconsistent"
        )
    return family


def _canonical(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _processor_class(processor: Any) -> str:
    """The processor's class less its backend suffix (transformers 5: ``...Pil``; 4: ``...Fast``)."""
    name = type(processor).__name__
    for backend in ("Pil", "Fast"):
        name = name.removesuffix(backend)
    return name


def _auto_processor(model_dir: Path, policy: ResolutionPolicy) -> Any:
    # The same class AutoProcessor (hence vLLM's pixel path) picks, so pixel and token inputs agree.
    return AutoImageProcessor.from_pretrained(model_dir, min_pixels=policy.min_pixels, max_pixels=policy.max_pixels)


def _build_processor(model_dir: Path, policy: ResolutionPolicy, vision_config: Any):
    processor = _auto_processor(model_dir, policy)
    if (processor.patch_size, processor.merge_size) != (vision_config.patch_size, vision_config.spatial_merge_size):
        raise ValueError(
            f"{model_dir}: the image processor (patch {processor.patch_size}, merge {processor.merge_size}) does "
            f"not match the vision tower (patch {vision_config.patch_size}, merge "
            f"{vision_config.spatial_merge_size}); fix the checkpoint's processor config"
        )
    return processor


def _build_visual(
    family: VisionFamily, vision_config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype
) -> torch.nn.Module:
    # Skip the random init: every parameter is overwritten below (strict load), and init is slow for a
    # 600 M-parameter tower. Buffers such as the rotary inv_freq are still computed in __init__.
    with no_init_weights():
        visual = family.tower_class._from_config(vision_config, dtype=dtype)
    visual.load_state_dict({name: t.to(dtype) for name, t in state.items()}, strict=True)
    return visual.eval().requires_grad_(False)
