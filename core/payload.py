"""The one typed page payload of the Qdrant index, and the names of its vectors.

Ingestion writes a :class:`PagePayload` per page; every reader (retrieval hits, warm-up, the REST routes,
``mmrag ask --pages``, the evaluation commands) reads it back through :meth:`PagePayload.from_qdrant`. No
other module spells a payload key: filters name fields through :class:`PageField`.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields
from typing import Any

from core.keys import ImageKey, page_point_id
from core.pages import TextSource

# Named vectors of a page point: page text (MiniLM) and page image (open_clip). A page without text has no
# text vector; with the image channel off no page has an image vector.
TEXT_VECTOR = "text"
IMAGE_VECTOR = "image"


class PageField(str, enum.Enum):
    """Payload fields that readers filter or facet on (each gets a payload index on a Qdrant server)."""

    DOC_ID = "doc_id"
    DOC = "doc"
    PAGE = "page"
    CONTENT_HASH = "content_hash"
    TEXT_SOURCE = "text_source"


class PayloadError(ValueError):
    """A point whose payload is not a page payload of this version (written by an older mmrag, or by hand)."""


@dataclass(slots=True, frozen=True)
class PagePayload:
    doc_id: str
    doc: str  # file name, for citations and filters
    path: str  # resolved source path (the page image is rendered from it again on request)
    page: int  # 1-based
    num_pages: int
    file_sha256: str  # of the source file's bytes: an unchanged file is not re-ingested
    content_hash: str  # of the normalised page image
    image_key: ImageKey  # where the page's image tokens are stored
    image_tokens: int
    width: int
    height: int
    text: str
    text_source: TextSource
    fingerprint: str  # encoder, policy, DPI, OCR and embedders that produced this page

    @property
    def page_id(self) -> str:
        """The page's point id: what citations, ``GET /v1/documents`` and ``/v1/pages/{id}`` name."""
        return page_point_id(self.doc_id, self.page)

    def to_qdrant(self) -> dict[str, Any]:
        out = asdict(self)
        out["image_key"] = str(self.image_key)
        out["text_source"] = self.text_source.value
        return out

    @classmethod
    def from_qdrant(cls, payload: dict[str, Any] | None) -> PagePayload:
        data = dict(payload or {})
        missing = [f for f in FIELD_NAMES if f not in data]
        if missing:
            raise PayloadError(
                f"a point in the page index lacks {', '.join(missing)}: it was not written by this version of "
                "mmrag ingest. Re-create the index with `mmrag index reset --yes` and ingest again"
            )
        try:
            return cls(**{
                **{f: data[f] for f in FIELD_NAMES},
                "page": int(data["page"]), "num_pages": int(data["num_pages"]),
                "image_tokens": int(data["image_tokens"]), "width": int(data["width"]),
                "height": int(data["height"]), "image_key": ImageKey.parse(data["image_key"]),
                "text_source": TextSource(data["text_source"]),
            })
        except (TypeError, ValueError) as exc:
            raise PayloadError(
                f"a point in the page index has a malformed payload ({exc}); re-create the index with "
                "`mmrag index reset --yes` and ingest again"
            ) from exc


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(PagePayload))
