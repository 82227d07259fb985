"""Page types passed between ingestion, retrieval and the RAG pipeline."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from PIL import Image

from core.keys import ContentHash, ImageKey


class TextSource(str, enum.Enum):
    TEXT_LAYER = "text_layer"  # the PDF's own text
    OCR = "ocr"  # tesseract, for pages without a text layer
    NONE = "none"  # no text layer and OCR off (or OCR found nothing)


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


@dataclass(slots=True, frozen=True)
class PageRef:
    """A page as stored in the index: what retrieval returns and citations name."""

    doc_id: str
    doc: str
    page: int
    image_key: ImageKey
    text: str = ""
