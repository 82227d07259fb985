"""How a plan's images go to vLLM, in either deployment form (MMRAG_IMAGE_INPUT, mmrag/core/engine.ImageInput).

``embeds`` (form A): the stored image tokens as ``image_embeds``; vLLM runs no encoder. ``pixels`` (form B): the
stored pixels of the page (the very image its tokens were made from, lossless PNG in the same store entry), which
vLLM's processor resizes under the key's resolution policy (``mm_processor_kwargs``: the policy's min/max pixels,
the bounds the vision service's processor used) and its own encoder turns into tokens, cached in its encoder cache.

Either way each image's ``multi_modal_uuid`` is its mmrag :class:`ImageKey` (:func:`multi_modal_uuid`): vLLM uses
the uuid instead of hashing the content, for its processor, encoder and prefix caches alike, so the key carries
everything that changes the tokens. A client-chosen uuid can name stale pixels (vLLM #55547); a key cannot: its
content hash is of the pixels it names, its encoder version names the weights and preprocessing. In the pixels form
the suffix ``+pixels`` keeps vLLM's encoder's tokens apart from the vision service's: the two are equal in fp32
(tests/test_image_input.py) but round differently in bf16, and the KV of one must never serve the other.

Pooled tiers stay in the embeds form: pooling averages merged tokens after the projector, a step vLLM's encoder
does not take, so a plan holding a pooled key is sent as tokens (its usage says ``embeds``). So is a plan whose
images are under several policies (a tier's fallback to the nearest stored one): vLLM takes one processor setting
per prompt.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

from mmrag.core.engine import ImageInput
from mmrag.core.keys import ImageKey
from mmrag.core.pages import EncodedImage
from mmrag.core.payload import WITHOUT_PIXELS_FIX

PIXELS_UUID_SUFFIX = "+pixels"


class ImageInputError(ValueError):
    """A stored entry cannot be sent in the form the plan needs (no tokens for the embeds form, no pixels for the
    pixels form); the message names the fix."""


class ImageTokenCountError(RuntimeError):
    """vLLM expanded a prompt's images to another number of tokens than their stored entries say: its processor
    resized the pixels otherwise than the key's resolution policy (or the replica serves another template)."""


def multi_modal_uuid(key: ImageKey, form: ImageInput) -> str:
    """vLLM's cache key for ``key``'s image sent in ``form``: the full mmrag key (content, encoder, policy)."""
    return str(key) + (PIXELS_UUID_SUFFIX if form is ImageInput.PIXELS else "")


def plan_form(configured: ImageInput, keys: Sequence[ImageKey], feats: Sequence[EncodedImage]) -> ImageInput:
    """The form this plan's images are sent in: ``configured``, except that a pixels-form plan holding a pooled key
    or keys under several policies is sent as tokens (see the module docstring). Refuses an entry that cannot be
    sent in the form chosen."""
    form = configured
    if form is ImageInput.PIXELS and (any(k.policy.pooled for k in keys) or len({k.policy for k in keys}) > 1):
        form = ImageInput.EMBEDS
    for key, feat in zip(keys, feats, strict=True):
        if form is ImageInput.EMBEDS and not feat.has_tokens:
            why = ("it is under several resolution policies in one prompt, which vLLM's processor cannot resize "
                   "in one request" if configured is ImageInput.PIXELS else "MMRAG_IMAGE_INPUT=embeds")
            raise ImageInputError(
                f"{key} was ingested without image tokens (MMRAG_INGEST_IMAGE_TOKENS=false) and must be sent as "
                f"tokens ({why}): re-ingest with MMRAG_INGEST_IMAGE_TOKENS=true, or serve with "
                "MMRAG_IMAGE_INPUT=pixels")
        if form is ImageInput.PIXELS and feat.pixels_png is None:
            raise ImageInputError(
                f"{key} has no stored pixels: it was ingested in the embeds form. Fix: {WITHOUT_PIXELS_FIX}; or "
                "serve with MMRAG_IMAGE_INPUT=embeds")
    return form


def processor_kwargs(keys: Sequence[ImageKey], engine_pixels: tuple[int, int] | None) -> dict[str, Any]:
    """vLLM's per-request ``mm_processor_kwargs`` for a pixels-form plan: the resolution policy of its keys (one, by
    :func:`plan_form`), so vLLM resizes each page as the vision service's processor did and its token count is the
    key's; empty when that is the engine's own setting (``engine_pixels``, the standard tier: EngineConfig)."""
    if not keys or (keys[0].policy.min_pixels, keys[0].policy.max_pixels) == engine_pixels:
        return {}
    policy = keys[0].policy
    return {"size": {"shortest_edge": policy.min_pixels, "longest_edge": policy.max_pixels}}


def decode_pixels(feats: Sequence[EncodedImage]) -> list[Any]:
    """The stored pixels as PIL images (the in-process engine hands vLLM image objects)."""
    from PIL import Image

    out = []
    for feat in feats:
        with Image.open(io.BytesIO(feat.pixels_png or b"")) as image:
            out.append(image.convert("RGB"))
    return out


def pixels_part(uuid: str, feat: EncodedImage) -> dict[str, Any]:
    """One chat content part carrying the stored pixels (lossless PNG as a data URL) under ``uuid``."""
    data = base64.b64encode(feat.pixels_png or b"").decode("ascii")
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}, "uuid": uuid}


def uncached_images(spans: Sequence[tuple[int, int]], cached_tokens: int) -> int:
    """Images of a pixels-form prompt not wholly inside its cached prefix: the vision forwards it may have cost (an
    upper bound: vLLM's encoder cache may still hold some of them, and vLLM counts no encoder-cache hits)."""
    return sum(1 for start, n in spans if start + n > cached_tokens)


def count_mismatch(form: ImageInput, expected_prompt_tokens: int, engine_prompt_tokens: int) -> str:
    """Why a prompt's token count differs from the local render's (empty when it does not)."""
    if expected_prompt_tokens == engine_prompt_tokens:
        return ""
    cause = ("vLLM's processor resized the pixels otherwise than the key's resolution policy, so their token "
             "counts differ from the stored entries'; serve with MMRAG_IMAGE_INPUT=embeds, or fix the checkpoint's "
             "image processor config" if form is ImageInput.PIXELS else
             "the engine serves another tokenizer or chat template than the checkpoint MMRAG_MODEL names")
    return (f"vLLM's prompt has {engine_prompt_tokens} tokens where the stored image entries and the local render "
            f"give {expected_prompt_tokens}: {cause}")
