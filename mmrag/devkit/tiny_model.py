"""Tiny random-weight Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints, built offline in seconds, for tests.

Each checkpoint is a real member of its family (same architecture and processor as the released models, just
small; Qwen2.5-VL's window attention and Qwen3-VL's deepstack included) so that vLLM, transformers and our
vision service load it exactly as they would a real one. All use the Qwen2-VL chat template (Qwen3-VL's own
template adds tool and reasoning parts but writes the same image placeholder).
Its weights are random: answers generated with it mean nothing, and the ``mmrag_model.json`` marker lets
the CLI and the service say so plainly. See /work/shared/notes/vllm-cpu.md, "A tiny Qwen2-VL made offline".

Only the build needs torch/transformers/tokenizers; they are imported inside it. The marker it writes is read
by ``mmrag/adapters/checkpoint.py`` (cheap: no torch, no vLLM).
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from mmrag.adapters.checkpoint import MARKER_FILE, read_marker

# The checkpoint's model_type -> the name its marker (and vLLM's served model) carries.
MODEL_NAMES = {
    "qwen2_vl": "mmrag-tiny-qwen2vl", "qwen2_5_vl": "mmrag-tiny-qwen2.5vl", "qwen3_vl": "mmrag-tiny-qwen3vl",
}
MODEL_NAME = MODEL_NAMES["qwen2_vl"]  # the default family's, which the service builds when no model is set
# model_type -> the transformers class prefix of its config, model and processor (imported only to build).
_CLASSES = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}

# The 14 added tokens of the released Qwen2-VL tokenizers, in their id order.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The chat template shipped with Qwen2-VL-*-Instruct and Qwen2.5-VL-*-Instruct (the same): an image content
# part becomes <|vision_start|><|image_pad|><|vision_end|>, which the processor/engine expands to the
# image's tokens.
QWEN2VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Tokenizer training text: a fixed, ordered list of stdlib sources (code plus English docstrings), so the
# tokenizer is identical on every build with the same Python. Any Python 3.11+ ships all of them.
_CORPUS_FILES = (
    "argparse.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "functools.py",
    "json/decoder.py",
    "json/encoder.py",
    "pathlib.py",
    "string.py",
    "textwrap.py",
)

_HEAD_DIM = 64  # fixed so that mrope_section [8, 12, 12] (sums to head_dim / 2) fits every size
_MROPE_SECTION = [8, 12, 12]
_INIT_STD = 0.08  # the default 0.02 gives near-uniform logits: greedy outputs would not depend on the image
_VOCAB_MULTIPLE = 64
# Qwen2.5-VL window attention, as released: 112-pixel windows (4x4 merged tokens), full attention in the
# last block of each group (here: the last block), so both attention kinds run in the tiny tower.
_WINDOW_SIZE = 112


@dataclass(slots=True, frozen=True)
class TinyModelSpec:
    """Everything that determines the checkpoint's bytes; recorded in the marker file."""

    seed: int = 0
    family: str = "qwen2_vl"  # the checkpoint's model_type
    hidden: int = 256  # text hidden size = image token width
    layers: int = 2
    vision_depth: int = 2
    vision_embed_dim: int = 128
    bpe_vocab: int = 2000  # before the 14 special tokens and padding
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448  # a 448x448 image -> 256 image tokens
    max_positions: int = 4096

    def __post_init__(self) -> None:
        if self.family not in _CLASSES:
            raise ValueError(
                f"no tiny model for family {self.family!r}; tiny models exist for {', '.join(_CLASSES)}"
            )
        # kv heads = heads / 2 with head_dim 64, hence multiples of 128.
        if self.hidden % (2 * _HEAD_DIM) or self.vision_embed_dim % _HEAD_DIM:
            raise ValueError(
                f"hidden must be a multiple of {2 * _HEAD_DIM} and vision_embed_dim of {_HEAD_DIM}, "
                f"got {self.hidden}, {self.vision_embed_dim}"
            )


def build_tiny_model(
    out: Path,
    *,
    seed: int = 0,
    family: str = "qwen2_vl",
    hidden: int = 256,
    layers: int = 2,
    vision_depth: int = 2,
    vision_embed_dim: int = 128,
    min_pixels: int = 56 * 56,
    max_pixels: int = 448 * 448,
    max_positions: int = 4096,
) -> Path:
    """Build a random-weight checkpoint of ``family`` (a model_type in ``MODEL_NAMES``) in ``out`` (which must
    not exist) and return ``out``.

    Deterministic: the same arguments give byte-identical weight and tokenizer files (for one Python and
    transformers version: the tokenizer learns from the stdlib sources, config.json records the
    transformers version). The defaults give the ~3 M-parameter test model; larger ``hidden``, ``layers``,
    ``vision_depth`` give a benchmark model (hidden=1024, layers=8: 125 M parameters, ~5 s).
    """
    spec = TinyModelSpec(
        seed=seed,
        family=family,
        hidden=hidden,
        layers=layers,
        vision_depth=vision_depth,
        vision_embed_dim=vision_embed_dim,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        max_positions=max_positions,
    )
    return build_atomically(Path(out), lambda folder: _write_checkpoint(folder, spec))


def build_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """``write`` a checkpoint into a folder beside ``out`` (which must not exist), then rename it to ``out``: a
    crash never leaves a half-written model that looks valid."""
    if out.exists():
        raise FileExistsError(f"{out} already exists; remove it or build into another folder")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    if tmp.exists():  # left by an earlier crashed build of this same pid number
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def ensure_tiny_model(out: Path, **params: int | str) -> Path:
    """Return ``out`` if it already holds a tiny model built with ``params``, else build it there."""
    out = Path(out)
    wanted = asdict(TinyModelSpec(**params))
    marker = read_marker(out)
    # Markers written before families existed are Qwen2-VL builds with the same bytes.
    if marker is not None and {"family": "qwen2_vl", **marker.get("spec", {})} == wanted:
        return out
    if out.exists():
        raise FileExistsError(
            f"{out} exists but does not hold the tiny model {wanted}; remove it (it is rebuilt in seconds)"
        )
    return build_tiny_model(out, **params)


def _write_checkpoint(folder: Path, spec: TinyModelSpec) -> None:
    tokenizer = _build_tokenizer(spec)
    processor = _build_processor(tokenizer, spec)
    model = _build_model(tokenizer, spec)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    # transformers writes the weights through a private temp file (mode 0600); a model folder is shared data
    # (a container's serving user must read it), so give every file ordinary read permissions.
    for f in folder.iterdir():
        f.chmod(0o644)
    marker = {"name": MODEL_NAMES[spec.family], "random_weights": True, "seed": spec.seed, "spec": asdict(spec)}
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    missing = [name for name in _CORPUS_FILES if not (stdlib / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the tiny model's tokenizer trains on Python stdlib sources, but {missing} are missing under "
            f"{stdlib}; use a Python install that ships its .py sources (not a .pyc-only image)"
        )
    return [(stdlib / name).read_text(encoding="utf-8") for name in _CORPUS_FILES]


def _build_tokenizer(spec: TinyModelSpec):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.bpe_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    # Added after training so that, as in Qwen, they take the ids right after the BPE vocabulary.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN2VL_CHAT_TEMPLATE,
        model_max_length=spec.max_positions,
    )


def _family_class(spec: TinyModelSpec, kind: str):
    """``kind`` is "Config", "ForConditionalGeneration" or "Processor"."""
    import transformers

    return getattr(transformers, _CLASSES[spec.family] + kind)


def _patch_size(spec: TinyModelSpec) -> int:
    return 16 if spec.family == "qwen3_vl" else 14  # as released


def _build_processor(tokenizer, spec: TinyModelSpec):
    # Every family uses Qwen2-VL's image processor, as the released checkpoints do.
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

    pixels = {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels}
    patches = {"patch_size": _patch_size(spec), "temporal_patch_size": 2, "merge_size": 2}
    # transformers 5 requires a video processor even for an image-only use.
    if spec.family == "qwen3_vl":
        video = Qwen3VLVideoProcessor(size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
                                      **patches)
    else:
        video = Qwen2VLVideoProcessor(**pixels, **patches)
    return _family_class(spec, "Processor")(
        image_processor=Qwen2VLImageProcessor(**pixels, **patches),
        tokenizer=tokenizer,
        video_processor=video,
        chat_template=QWEN2VL_CHAT_TEMPLATE,
    )


def _vision_config(spec: TinyModelSpec) -> dict:
    common = {
        "depth": spec.vision_depth,
        "num_heads": spec.vision_embed_dim // _HEAD_DIM,
        "patch_size": _patch_size(spec),
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": _INIT_STD,
    }
    # Qwen2.5-VL and Qwen3-VL: hidden_size is the tower's width, out_hidden_size the merger's.
    widths = {
        "hidden_size": spec.vision_embed_dim,
        "intermediate_size": 4 * spec.vision_embed_dim,
        "out_hidden_size": spec.hidden,
    }
    if spec.family == "qwen2_5_vl":
        return common | widths | {"window_size": _WINDOW_SIZE, "fullatt_block_indexes": [spec.vision_depth - 1]}
    if spec.family == "qwen3_vl":
        # Every block but the last feeds a deepstack level (released: 3 of 27); 16x16 learned positions.
        return common | widths | {
            "deepstack_visual_indexes": list(range(spec.vision_depth - 1)),
            "num_position_embeddings": 256,
        }
    # Qwen2-VL: embed_dim is the tower's width, hidden_size the merger's (projected to the text width).
    return common | {"embed_dim": spec.vision_embed_dim, "hidden_size": spec.hidden}


def _build_config(tokenizer, spec: TinyModelSpec):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    vocab_size = -(-len(tokenizer) // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    heads = spec.hidden // _HEAD_DIM
    text = {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": 4 * spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        **({"head_dim": _HEAD_DIM} if spec.family == "qwen3_vl" else {}),  # Qwen3 does not derive it
        "max_position_embeddings": spec.max_positions,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(_MROPE_SECTION)}
        | ({"mrope_interleaved": True} if spec.family == "qwen3_vl" else {}),
        "initializer_range": _INIT_STD,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    return _family_class(spec, "Config")(
        text_config=text,
        vision_config=_vision_config(spec),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def _build_model(tokenizer, spec: TinyModelSpec):
    import torch
    from transformers import GenerationConfig

    config = _build_config(tokenizer, spec)
    model = _family_class(spec, "ForConditionalGeneration")(config).to(torch.float32).eval()
    _init_weights(model, spec.seed)
    text = config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=[text.eos_token_id, text.bos_token_id],
        pad_token_id=text.pad_token_id,
    )
    return model


def _init_weights(model, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, in name order: the bytes depend on the seed only."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim >= 2:  # linear, embedding and patch-conv weights
                param.normal_(0.0, _INIT_STD, generator=gen)
            elif name.endswith("bias"):
                param.zero_()
            else:  # 1-D weights are norm scales
                param.fill_(1.0)
