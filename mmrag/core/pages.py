"""Page types passed between ingestion, retrieval and the RAG pipeline."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmrag.core.figures import FigureRegion
from mmrag.core.keys import ContentHash

if TYPE_CHECKING:  # contracts import no torch/Pillow at run time (`mmrag --help` stays fast)
    import torch
    from PIL import Image


class TextSource(str, enum.Enum):
    TEXT_LAYER = "text_layer"  # the PDF's own text
    OCR = "ocr"  # tesseract, for pages without a text layer
    NONE = "none"  # no text layer and OCR off (or OCR found nothing)


@dataclass(slots=True, frozen=True)
class FigureCrop:
    """A figure of a rendered page as an image of its own (ingestion/figures.py crop_figures): an embedded
    picture's own pixels, or the figure's region rendered alone at a fixed scale."""

    region: FigureRegion
    image: Image.Image  # normalised: RGB
    content_hash: ContentHash
    # The words drawn inside it: its text objects, or a raster's OCR (mmrag.core.figures.figure_words); what its
    # figure point is found by besides its caption and the sentences naming it (figure_text).
    words: str = ""


@dataclass(slots=True)
class RenderedPage:
    """One page as loaded from a source file, before encoding."""

    doc_id: str
    doc: str  # file name, for citations
    path: str  # resolved source path
    page: int  # 1-based
    image: Image.Image  # normalised: RGB
    content_hash: ContentHash
    text: str = ""
    text_source: TextSource = TextSource.NONE
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    figures: list[FigureCrop] = field(default_factory=list)  # PDFs with MMRAG_FIGURES on; in reading order
    figures_skipped: str = ""  # why the figure step skipped this page (over its object or time bound), else ""


@dataclass(slots=True, frozen=True, eq=False)  # eq=False: tensors have no boolean ==
class EncodedImage:
    """One page's image tokens as the vision encoder produced them (ViT + merger output), in the layout vLLM
    takes as ``image_embeds``: one row per image token, the LLM's hidden size wide; for Qwen3-VL each row is
    the merged token followed by its deepstack features, (1 + levels) x hidden wide (mmrag/adapters/families.py)."""

    image_tokens: torch.Tensor  # (n_tokens, width), contiguous, CPU, owns its storage; width 0: not encoded
    grid_thw: torch.Tensor  # (1, 3) int64: temporal, height, width patches before merging
    # The image the tokens were made from, as lossless PNG bytes (the pixels form, MMRAG_IMAGE_INPUT=pixels:
    # vLLM encodes them itself); None where only tokens are kept.
    pixels_png: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.image_tokens.shape[0])

    @property
    def has_tokens(self) -> bool:
        """False for an entry ingested in the pixels form without its tokens (MMRAG_INGEST_IMAGE_TOKENS=false):
        its token count and grid are known (the resize rule), the tokens are vLLM's to make."""
        return int(self.image_tokens.shape[-1]) > 0
