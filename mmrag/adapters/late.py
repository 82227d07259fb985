"""Late-interaction page-image retrieval (ColPali family) on ``colpali-engine``: one multi-vector per page.

A checkpoint (``MMRAG_PAGE_RETRIEVER``: a local folder in colpali-engine's format, e.g. a copy of
``vidore/colqwen2-v1.0-merged``, or the tiny random-weight one from mmrag/devkit/tiny_colqwen.py) embeds a page image
into one 128-d vector per token of its prompt (the image's merged visual tokens plus ~10-20 prompt tokens) and a
query into one per query token (plus colpali-engine's 10 augmentation tokens). A page scores
``maxsim(query, page)``: for each query row the best dot product with any page row, summed.

Storage and search helpers: ``mean_pool`` (the single dense vector a two-stage search prefetches on),
``pool_tokens`` (hierarchical token pooling, the usual ~n/3 storage saving), ``maxsim`` (the reference scorer).

torch, transformers and colpali_engine are imported inside the constructor only: importing this module is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mmrag.adapters.checkpoint import read_marker

if TYPE_CHECKING:
    from PIL import Image

ENV_VAR = "MMRAG_PAGE_RETRIEVER"

# config.json "architectures" entry -> (colpali_engine model class, processor class). colpali-engine's own
# (merged) checkpoints name these; the transformers-native "-hf" ones (ColQwen2ForRetrieval) are another API.
_ARCHITECTURES = {
    "ColQwen2": ("ColQwen2", "ColQwen2Processor"),
    "ColQwen2_5": ("ColQwen2_5", "ColQwen2_5_Processor"),
    "ColPali": ("ColPali", "ColPaliProcessor"),
}
# A checkpoint without "architectures": its model_type decides (colpali-engine models keep the backbone's).
_MODEL_TYPES = {"qwen2_vl": "ColQwen2", "qwen2_5_vl": "ColQwen2_5", "paligemma": "ColPali"}
# Backbones whose image processor takes a pixel budget (Qwen2-VL's dynamic resolution); PaliGemma is fixed 448.
_PIXEL_BUDGET = {"ColQwen2", "ColQwen2_5"}
_EPS = 1e-12


def _unit_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(norms, _EPS)).astype(np.float32, copy=False)


def resolve_architecture(path: Path) -> str:
    """The colpali-engine class (a key of ``_ARCHITECTURES``) for the checkpoint folder ``path``.

    FileNotFoundError when the folder is missing, ValueError when it is not a supported late-interaction
    checkpoint; both name MMRAG_PAGE_RETRIEVER and what to point it at."""
    path = Path(path).expanduser()
    supported = ", ".join(_ARCHITECTURES)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{ENV_VAR}={path}: no such folder. Point it at a local late-interaction checkpoint folder in "
            f"colpali-engine format ({supported}; e.g. a copy of vidore/colqwen2-v1.0-merged); mmrag never "
            "downloads at run time"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        if (path / "adapter_config.json").is_file():
            raise ValueError(
                f"{ENV_VAR}={path} holds a LoRA adapter only (adapter_config.json, no config.json); point it at a "
                "merged checkpoint (e.g. vidore/colqwen2-v1.0-merged) or merge the adapter into its base first"
            )
        raise ValueError(f"{ENV_VAR}={path} has no config.json: not a model checkpoint ({supported} supported)")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    architectures = config.get("architectures") or []
    for arch in architectures:
        if arch in _ARCHITECTURES:
            return arch
    model_type = config.get("model_type")
    if not architectures and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    hint = ""
    if any(a.endswith("ForRetrieval") for a in architectures):
        hint = " (a transformers-native '-hf' checkpoint: use the colpali-engine one, e.g. vidore/colqwen2-v1.0-merged)"
    elif any(a.endswith("ForConditionalGeneration") for a in architectures):
        hint = " (a generative VLM, which is MMRAG_MODEL's job, not a retriever)"
    raise ValueError(
        f"{ENV_VAR}={path} is not a supported late-interaction checkpoint: architectures={architectures}, "
        f"model_type={model_type!r}{hint}; supported: {supported}"
    )


class LateInteractionRetriever:
    """Embeds page images and queries into L2-normalised multi-vectors (one float32 ``(n_tokens, dim)`` array
    each, padding rows dropped) with a ColQwen2 / ColQwen2.5 / ColPali checkpoint, on the CPU.

    ``dtype``: "auto" is float32 for a random-weight (test) checkpoint, else what this CPU runs natively
    (mmrag.adapters.hardware.native_cpu_dtype: bfloat16 with AVX512-BF16/AMX, float32 otherwise); outputs are float32
    either way. ``max_pixels`` overrides the checkpoint's pixel budget (Qwen2-VL backbones only; one merged
    visual token per 28x28 pixels).
    """

    def __init__(self, path: Path, *, batch_size: int = 4, max_pixels: int | None = None,
                 dtype: str = "auto") -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        path = Path(path).expanduser()
        arch = resolve_architecture(path)
        if max_pixels is not None and arch not in _PIXEL_BUDGET:
            raise ValueError(f"max_pixels applies to Qwen2-VL-based retrievers only; {arch} takes fixed-size images")

        import colpali_engine.models as cm
        import torch

        marker = read_marker(path)
        self.random_weights: bool = bool(marker and marker.get("random_weights") is True)
        if dtype == "auto":
            from mmrag.adapters.hardware import native_cpu_dtype

            dtype = "float32" if self.random_weights else native_cpu_dtype()
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16 on the CPU, got {dtype!r}")
        self.dtype: str = dtype
        self.architecture: str = arch
        self.path: Path = path.resolve()
        self.batch_size = batch_size
        self.name: str = self.path.name + (" (random weights)" if self.random_weights else "")

        model_cls, processor_cls = (getattr(cm, n) for n in _ARCHITECTURES[arch])
        self._torch = torch
        self._model = model_cls.from_pretrained(
            str(self.path), dtype=getattr(torch, dtype), local_files_only=True
        ).to("cpu").eval()
        self._processor = processor_cls.from_pretrained(str(self.path), local_files_only=True)
        if max_pixels is not None:
            ip = self._processor.image_processor
            ip.size["longest_edge"] = max_pixels  # what transformers 5's Qwen2-VL image processor reads
        self.dim: int = int(self._model.dim)

    @property
    def max_pixels(self) -> int | None:
        size = getattr(self._processor.image_processor, "size", None)
        try:
            return int(size["longest_edge"])
        except (TypeError, KeyError):
            return None

    def embed_pages(self, images: list[Image.Image]) -> list[np.ndarray]:
        """One ``(n_tokens, dim)`` float32 array per image, rows L2-normalised: every real (non-padding) token
        of the page prompt, visual tokens and prompt text together (colpali-engine's default)."""
        return self._embed(images, self._processor.process_images)

    def embed_queries(self, texts: list[str]) -> list[np.ndarray]:
        """One ``(n_tokens, dim)`` float32 array per query (its tokens plus the 10 augmentation tokens
        colpali-engine appends), rows L2-normalised, padding dropped."""
        return self._embed(texts, self._processor.process_queries)

    def _embed(self, items: list[Any], process) -> list[np.ndarray]:
        torch = self._torch
        out: list[np.ndarray] = []
        for start in range(0, len(items), self.batch_size):
            batch = process(items[start:start + self.batch_size])
            with torch.inference_mode():
                embeddings = self._model(**batch)  # (B, L, dim), padding rows zeroed
            mask = batch["attention_mask"].bool()
            for row, keep in zip(embeddings, mask):
                out.append(_unit_rows(row[keep].to(torch.float32).numpy()).copy())
        return out


def maxsim(query: np.ndarray, page: np.ndarray) -> float:
    """Late-interaction score: for each query row the largest dot product with a page row, summed."""
    return float((np.asarray(query, np.float32) @ np.asarray(page, np.float32).T).max(axis=1).sum())


def mean_pool(multi: np.ndarray) -> np.ndarray:
    """The mean of a multi-vector's rows, L2-normalised: ``(dim,)`` float32, the single vector a two-stage
    search prefetches on before the MaxSim rerank."""
    mean = np.asarray(multi, np.float32).mean(axis=0)
    return (mean / max(float(np.linalg.norm(mean)), _EPS)).astype(np.float32)


def pool_tokens(multi: np.ndarray, factor: int) -> np.ndarray:
    """Hierarchical token pooling: cluster the rows into ``max(n // factor, 1)`` groups and keep each group's
    L2-normalised mean (rows L2-normalised). ``factor`` 1, or a single row, returns the input unchanged.

    Our own, not colpali-engine's HierarchicalTokenPooler: Ward linkage on the unit rows themselves (for unit
    vectors squared Euclidean distance is 2 - 2 cos, so this clusters by cosine): 25-90 ms for a 760-row page on
    a 2-core EPYC (idle to busy) against the pooler's 175-270 ms, which clusters the rows of the n x n distance
    matrix as n-dimensional points. Same cluster count and the same mean-then-normalise of each cluster.
    """
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    multi = np.asarray(multi, np.float32)
    n = multi.shape[0]
    if factor == 1 or n <= 1:
        return multi
    from scipy.cluster.hierarchy import fcluster, linkage

    clusters = max(n // factor, 1)
    labels = fcluster(linkage(multi.astype(np.float64), method="ward"), t=clusters, criterion="maxclust") - 1
    members = labels[None, :] == np.unique(labels)[:, None]  # (clusters, n): which rows each cluster holds
    return _unit_rows(members.astype(np.float32) @ multi)  # sum, then normalise = normalised mean
