"""The model-family registry: what the vision service needs to know about each supported VLM family.

One entry per checkpoint ``model_type``: the module that is the vision tower + projector alone, where its
weights sit in the checkpoint, which of its config fields change the tokens without changing the weights
(they enter the encoder version), the image placeholder the chat template writes, how many tokens an
image takes under a resolution policy, and the ``image_embeds`` item vLLM takes. Everything else about a
checkpoint (LLM, tokenizer, template) is read from the checkpoint itself.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmrag.adapters.checkpoint import local_checkpoint
from mmrag.core.pages import EncodedImage

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# transformers 5 names the tower "model.visual.*"; checkpoints saved by transformers 4 (all released
# Qwen2-VL / Qwen2.5-VL models) and by transformers 5's save_pretrained use "visual.*".
QWEN_VISUAL_PREFIXES = ("model.visual.", "visual.")
# Written by the Qwen chat templates for an image content part; the engine expands <|image_pad|> to the
# image's tokens.
QWEN_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

# Families vLLM serves that the vision service does not produce tokens for yet, with the reason.
_NOT_YET = {
    "qwen3_vl_moe": "only dense Qwen3-VL checkpoints are supported so far",
}


@dataclass(frozen=True, slots=True)
class VisionFamily:
    """How one VLM family's vision tower + projector is loaded, versioned and handed to vLLM."""

    model_type: str  # the checkpoint's config.json model_type
    label: str  # the family's name in messages
    # The vision tower + merger class, built from config.vision_config, as "module:Class": imported when a tower
    # is built (tower_class), not with the registry. transformers' modelling modules take ~4 s to import, and a
    # process that only asks a family's placeholder or token count (a remote engine, a router) never builds one.
    tower: str
    out_width_field: str  # vision_config field holding the merger's output width (= the LLM's hidden size)
    # vision_config fields that can change the tokens while every tensor stays the same; hashed into the
    # encoder version. Empty for Qwen2-VL: its versions predate the registry and must stay valid, so a Qwen2-VL
    # head-count or activation edit is not detected (see encoder_version).
    versioned_config_fields: tuple[str, ...] = ()
    visual_prefixes: tuple[str, ...] = QWEN_VISUAL_PREFIXES
    image_placeholder: str = QWEN_IMAGE_PLACEHOLDER
    image_pad_token: str = "<|image_pad|>"  # the placeholder's token that the engine repeats once per image token
    # Qwen3-VL: the tower also returns features of some inner blocks ("deepstack"), which vLLM adds to the
    # LLM's first layers; they travel in image_embeds beside the merged tokens.
    deepstack: bool = False

    @property
    def tower_class(self) -> type[PreTrainedModel]:
        module, name = self.tower.split(":")
        return getattr(importlib.import_module(module), name)

    def out_width(self, vision_config: Any) -> int:
        return int(getattr(vision_config, self.out_width_field))

    def versioned_config(self, vision_config: Any) -> dict[str, Any]:
        return {name: _plain(getattr(vision_config, name)) for name in self.versioned_config_fields}

    def image_embeds(self, output: Any) -> torch.Tensor:
        """The tower's output as vLLM's ``image_embeds`` rows, one per image token: the merged tokens, then
        each deepstack level's features, concatenated along the width (the split vLLM's qwen3_vl.py makes)."""
        if not self.deepstack:
            return output.pooler_output
        return torch.cat([output.pooler_output, *output.deepstack_features], dim=1)

    def num_tokens(self, image_processor: Any, merge_size: int, width: int, height: int) -> int:
        """Image tokens a ``width`` x ``height`` image takes under the processor's resize rule (min/max pixels
        come from the resolution policy): patches after resizing, merged ``merge_size``² to one token."""
        return image_processor.get_number_of_image_patches(height, width) // merge_size**2

    def vllm_image_item(self, features: list[EncodedImage]) -> dict[str, torch.Tensor]:
        """All images of a prompt as one precomputed ``image_embeds`` item set (vLLM splits it by grid)."""
        return {
            "image_embeds": torch.cat([f.image_tokens for f in features]),
            "image_grid_thw": torch.cat([f.grid_thw for f in features]),
        }


FAMILIES: dict[str, VisionFamily] = {
    f.model_type: f
    for f in (
        VisionFamily("qwen2_vl", "Qwen2-VL",
                     "transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel",
                     "hidden_size"),
        VisionFamily(
            "qwen2_5_vl",
            "Qwen2.5-VL",
            "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
            "out_hidden_size",
            # Window attention: which blocks attend fully and the window size change every token, as do the
            # head count and activation, all with identical tensors.
            versioned_config_fields=(
                "window_size", "fullatt_block_indexes", "num_heads", "hidden_act", "spatial_merge_size",
                "patch_size", "temporal_patch_size",
            ),
        ),
        VisionFamily(
            "qwen3_vl",
            "Qwen3-VL",
            "transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
            "out_hidden_size",
            # Which blocks feed the deepstack levels changes the tokens, not the tensors.
            versioned_config_fields=(
                "deepstack_visual_indexes", "num_heads", "hidden_act", "spatial_merge_size", "patch_size",
                "temporal_patch_size",
            ),
            deepstack=True,
        ),
    )
}


class UnsupportedFamilyError(ValueError):
    """A checkpoint whose model_type the vision service cannot encode for."""


def family_for(model_type: str, where: object = "the checkpoint") -> VisionFamily:
    """The registry entry for ``model_type``; anything else is refused with the supported list."""
    family = FAMILIES.get(model_type)
    if family is not None:
        return family
    supported = ", ".join(f"{f.model_type} ({f.label})" for f in FAMILIES.values())
    reason = f" ({_NOT_YET[model_type]})" if model_type in _NOT_YET else ""
    raise UnsupportedFamilyError(
        f"{where} is a {model_type!r} model, which the vision service does not support{reason}; supported "
        f"families: {supported} (set MMRAG_MODEL to a checkpoint of one of them)"
    )


def checkpoint_family(model_path: str | Path) -> VisionFamily:
    """The family of a checkpoint, from its config.json ``model_type`` (no weights read)."""
    model_dir = local_checkpoint(model_path)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return family_for(str(config.get("model_type")), model_dir)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
