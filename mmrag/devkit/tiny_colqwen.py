"""A tiny random-weight ColQwen2 (late-interaction page retriever), built offline in seconds, for tests.

It is a real ColQwen2 (``colpali_engine.models.ColQwen2`` on a Qwen2-VL backbone, with its 128-d
``custom_text_proj`` head, and ``ColQwen2Processor``), only small: so ``ColQwen2.from_pretrained(path)`` and
``ColQwen2Processor.from_pretrained(path)`` load it offline exactly as they would ``vidore/colqwen2-v1.0-merged``.
The tokenizer, image processor, config and seeded initialisation are the tiny Qwen2-VL's (mmrag/devkit/tiny_model.py).

Its weights are random: the multi-vectors it makes have the right shapes and are deterministic, but retrieval
with them means nothing. The ``mmrag_model.json`` marker (mmrag/adapters/checkpoint.py) says so, and the retriever
(mmrag/adapters/late.py) names itself "(random weights)".
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from mmrag.adapters.checkpoint import MARKER_FILE, read_marker
from mmrag.devkit.tiny_model import (
    QWEN2VL_CHAT_TEMPLATE,
    TinyModelSpec,
    _build_config,
    _build_processor,
    _build_tokenizer,
    _init_weights,
    build_atomically,
)

MODEL_NAME = "mmrag-tiny-colqwen2"
# The released ColQwen2 caps a page at 768 merged visual tokens (max_num_visual_tokens=768 -> 768 * 28 * 28
# pixels): an A4 page at that cap gives ~740-768 image tokens. The tiny one keeps the same cap, so page token
# counts (and Qdrant sizes) look like a real one's; a 448x448 page gives 256 image tokens.
MAX_VISUAL_TOKENS = 768
# Small: text hidden 128 (the tiny builder's minimum: 2 heads of 64), 2 layers, a 2-block vision tower of
# width 64. The ColQwen2 projection head is always 128-d (colpali-engine fixes `dim = 128`).
_SPEC = dict(family="qwen2_vl", hidden=128, layers=2, vision_depth=2, vision_embed_dim=64,
             min_pixels=4 * 28 * 28, max_pixels=MAX_VISUAL_TOKENS * 28 * 28)
_KIND = "colqwen2"  # recorded in the marker, so a tiny VLM folder is never taken for this one


def _spec(seed: int) -> TinyModelSpec:
    return TinyModelSpec(seed=seed, **_SPEC)


def _marker_spec(spec: TinyModelSpec) -> dict:
    return {"kind": _KIND, **asdict(spec)}


def build_tiny_colqwen2(out: Path, *, seed: int = 0) -> Path:
    """Build the random-weight ColQwen2 into ``out`` (which must not exist) and return ``out``.

    Deterministic: the same seed gives the same weights (same Python and transformers version, as the tiny VLM).
    """
    spec = _spec(seed)
    return build_atomically(Path(out), lambda folder: _write_checkpoint(folder, spec))


def ensure_tiny_colqwen2(out: Path, *, seed: int = 0) -> Path:
    """Return ``out`` if it already holds the tiny ColQwen2 built with ``seed``, else build it there."""
    out = Path(out)
    marker = read_marker(out)
    if marker is not None and marker.get("spec") == _marker_spec(_spec(seed)):
        return out
    if out.exists():
        raise FileExistsError(
            f"{out} exists but does not hold the tiny ColQwen2 (seed {seed}); remove it (it is rebuilt in seconds)"
        )
    return build_tiny_colqwen2(out, seed=seed)


def _write_checkpoint(folder: Path, spec: TinyModelSpec) -> None:
    import torch
    from colpali_engine.models import ColQwen2, ColQwen2Processor

    tokenizer = _build_tokenizer(spec)
    base = _build_processor(tokenizer, spec)  # the tiny Qwen2-VL's processor: reuse its parts
    processor = ColQwen2Processor(
        image_processor=base.image_processor,
        tokenizer=tokenizer,
        video_processor=base.video_processor,
        chat_template=QWEN2VL_CHAT_TEMPLATE,
    )
    model = ColQwen2(_build_config(tokenizer, spec)).to(torch.float32).eval()
    _init_weights(model, spec.seed)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    for f in folder.iterdir():  # transformers writes weights 0600; a model folder is shared data
        f.chmod(0o644)
    marker = {
        "name": MODEL_NAME,
        "random_weights": True,
        "note": "random weights: late-interaction scores from this checkpoint are meaningless (tests only)",
        "seed": spec.seed,
        "spec": _marker_spec(spec),
    }
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
