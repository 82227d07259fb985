"""The one typed page payload of the Qdrant index, and the names of its vectors.

Ingestion writes a :class:`PagePayload` per page; every reader (retrieval hits, warm-up, the REST routes,
``mmrag ask --pages``, the evaluation commands) reads it back through :meth:`PagePayload.from_qdrant`. No
other module spells a payload key: filters name fields through :class:`PageField`.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

from mmrag.core.figures import PageFigure
from mmrag.core.keys import EncoderVersion, ImageKey, ResolutionPolicy, page_point_id
from mmrag.core.pages import TextSource

# Named vectors of a page point (issue 25):
# - ``text``: page text, dense (MiniLM); a page without text has none;
# - ``lexical``: page text, sparse BM25 term weights (mmrag/adapters/lexical.py), Qdrant applying IDF (Modifier.IDF);
# - the page-image channel, one of (MMRAG_PAGE_RETRIEVER): ``image``, a CLIP vector (open_clip), or ``page``,
#   a late-interaction multi-vector (ColQwen2/ColPali: MaxSim) with ``page_mean``, its mean-pooled single vector
#   that prefetches candidates for the MaxSim re-rank. With the channel off no page has any of them.
TEXT_VECTOR = "text"
LEXICAL_VECTOR = "lexical"
IMAGE_VECTOR = "image"
PAGE_VECTOR = "page"
PAGE_MEAN_VECTOR = "page_mean"


class PageField(str, enum.Enum):
    """Payload fields that readers filter or facet on (each gets a payload index on a Qdrant server)."""

    DOC_ID = "doc_id"
    DOC = "doc"
    PAGE = "page"
    CONTENT_HASH = "content_hash"
    TEXT_SOURCE = "text_source"
    # Parts of ``image_key``, written beside it because Qdrant cannot filter on part of a string: serving
    # filters on them so that pages encoded by another encoder are never retrieved (see EncoderScope).
    ENCODER_VERSION = "encoder_version"
    RESOLUTION_POLICY = "resolution_policy"
    # "figure" on a figure point (issue 26): one per figure of a page with text to find it by (its caption, the
    # page's sentences that name it), searched by the figure channel. Its payload is its page's, plus
    # FIGURE_INDEX (which of the page's ``figures``) and FIGURE_PARENT (the page's point id), so a hit on it is a
    # hit on its page with the figure named. A point without KIND is a page; every page reader leaves figure
    # points out (mmrag/adapters/qdrant.py PAGES_ONLY).
    KIND = "kind"


FIGURE_KIND = "figure"
FIGURE_INDEX = "figure_index"
FIGURE_PARENT = "parent"


@dataclass(slots=True, frozen=True)
class EncoderScope:
    """The image keys the configured vision encoder serves: its version under its resolution policy.

    Tokens under any other key came from another encoder (a model or projector upgrade, a changed
    MMRAG_ENCODER_SALT or pixel bounds); feeding them to the VLM degrades answers without any error.
    """

    version: EncoderVersion
    policy: ResolutionPolicy

    @classmethod
    def of(cls, key: ImageKey) -> EncoderScope:
        return cls(key.encoder_version, key.policy)

    def covers(self, key: ImageKey) -> bool:
        return EncoderScope.of(key) == self

    def payload_match(self) -> dict[str, str]:
        """The payload values of every page whose tokens this encoder made."""
        return {PageField.ENCODER_VERSION.value: self.version, PageField.RESOLUTION_POLICY.value: str(self.policy)}

    def __str__(self) -> str:
        return f"{self.version}/{self.policy}"


# `mmrag reencode` comes first: it is the command for exactly this case (only the image tokens are stale, not the
# text or the vectors), and it costs one vision forward per page where re-ingesting also re-embeds and re-OCRs.
# What an entry stored without its pixels (ingested in the embeds form) needs to be served in the pixels form.
WITHOUT_PIXELS_FIX = ("run `mmrag reencode` with MMRAG_IMAGE_INPUT=pixels: it adds each page's pixels to its entries, "
                      "no vision forward")

STALE_PAGES_FIX = (
    "run `mmrag reencode` (`mmrag reencode --dry-run` first says how many pages and forwards; with tenants, once "
    "per `--tenant`): it re-encodes their image tokens for the configured encoder and keeps their text and "
    "vectors. Or re-ingest those documents (`mmrag ingest PATH...`), or set MMRAG_MODEL / MMRAG_ENCODER_SALT / "
    "MMRAG_MIN_PIXELS / MMRAG_MAX_PIXELS back to what encoded them (`mmrag index check` lists the encoders)"
)


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
    # Caption lines of the page ("Figure 12: ...", "Table 2 ...", a slide's title), normalised (mmrag/core/text.py):
    # weighed in the lexical channel and shown with citations. Absent in pages indexed before issue 25.
    captions: tuple[str, ...] = ()
    # The page's figures (PDFs, MMRAG_FIGURES on; mmrag/core/figures.py), each with the image entry of its crop. Absent
    # in pages indexed before issue 26.
    figures: tuple[PageFigure, ...] = ()

    @property
    def image_keys(self) -> tuple[ImageKey, ...]:
        """Every feature-store entry this page references: its image's, then each figure crop's. What keeps an
        entry from `mmrag store gc` and what deleting the page frees."""
        return (self.image_key, *(f.image_key for f in self.figures))

    @property
    def page_id(self) -> str:
        """The page's point id: what citations, ``GET /v1/documents`` and ``/v1/pages/{id}`` name."""
        return page_point_id(self.doc_id, self.page)

    def figure_payload(self, index: int) -> dict[str, Any]:
        """The payload of the figure point of its ``index``-th figure: the page's, and which figure of which page."""
        if not 0 <= index < len(self.figures):
            raise IndexError(f"page {self.page} of {self.doc} has {len(self.figures)} figures, not {index + 1}")
        return {**self.to_qdrant(), PageField.KIND.value: FIGURE_KIND, FIGURE_INDEX: index,
                FIGURE_PARENT: self.page_id}

    def to_qdrant(self) -> dict[str, Any]:
        out = asdict(self)
        out["image_key"] = str(self.image_key)
        out["text_source"] = self.text_source.value
        out["captions"] = list(self.captions)
        out["figures"] = [f.to_json() for f in self.figures]
        out.update(EncoderScope.of(self.image_key).payload_match())
        return out

    @classmethod
    def from_qdrant(cls, payload: dict[str, Any] | None) -> PagePayload:
        data = dict(payload or {})
        missing = [f for f in FIELD_NAMES if f not in data and f not in _OPTIONAL_NAMES]
        if missing and set(missing) <= set(_DERIVED_NAMES):
            raise PayloadError(
                "the page index was written before mmrag stored each page's encoder fields: open it once for "
                "writing to add them (`mmrag ingest PATH...`, any path), or re-create it with `mmrag index "
                "reset --yes` and ingest again"
            )
        if missing:
            raise PayloadError(
                f"a point in the page index lacks {', '.join(missing)}: it was not written by this version of "
                "mmrag ingest. Re-create the index with `mmrag index reset --yes` and ingest again"
            )
        try:
            page = cls(**{
                **{f: data[f] for f in _CONSTRUCTOR_FIELDS if f in data},
                "page": int(data["page"]), "num_pages": int(data["num_pages"]),
                "image_tokens": int(data["image_tokens"]), "width": int(data["width"]),
                "height": int(data["height"]), "image_key": ImageKey.parse(data["image_key"]),
                "text_source": TextSource(data["text_source"]),
                "captions": tuple(str(c) for c in data.get("captions") or ()),
                "figures": tuple(PageFigure.from_json(f) for f in data.get("figures") or ()),
            })
            if EncoderScope.of(page.image_key).payload_match() != {f: data[f] for f in _DERIVED_NAMES}:
                raise ValueError(f"its encoder fields disagree with its image key {page.image_key}")
            return page
        except (TypeError, ValueError, KeyError) as exc:
            raise PayloadError(
                f"a point in the page index has a malformed payload ({exc}); re-create the index with "
                "`mmrag index reset --yes` and ingest again"
            ) from exc


_CONSTRUCTOR_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(PagePayload))
_DERIVED_NAMES: tuple[str, ...] = (PageField.ENCODER_VERSION.value, PageField.RESOLUTION_POLICY.value)
_OPTIONAL_NAMES: frozenset[str] = frozenset({"captions", "figures"})  # fields added later: a page without one is whole
FIELD_NAMES: tuple[str, ...] = _CONSTRUCTOR_FIELDS + _DERIVED_NAMES  # every key a page's payload has


def pages_per_encoder(pages: Iterable[PagePayload]) -> Counter[EncoderScope]:
    """How many of ``pages`` each encoder (version and resolution policy) made."""
    return Counter(EncoderScope.of(p.image_key) for p in pages)


def encoder_fields_of(payload: dict[str, Any]) -> dict[str, str]:
    """The encoder fields a stored payload lacks, from its image key: what an index written before they
    existed is backfilled with (mmrag/adapters/qdrant.py)."""
    return EncoderScope.of(ImageKey.parse(payload["image_key"])).payload_match()
