"""The one typed key for image tokens, and the page identifiers derived in one place.

Every component that names cached image tokens or KV — ingestion, the feature store, the engine's
``multi_modal_uuids``, warm-up and metrics — uses :class:`ImageKey` and its ``str()`` form. vLLM uses the
uuid *verbatim* as the cache key of the image (it replaces the content hash), so the string must carry
everything that changes the tokens: the page content, the encoder and the resolution policy.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from typing import NewType

ContentHash = NewType("ContentHash", str)  # sha256 hex of the rendered, normalised page image
EncoderVersion = NewType("EncoderVersion", str)  # hex digest of vision weights + processor config + salt

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX = re.compile(r"^[0-9a-f]{8,64}$")
_KEY_RE = re.compile(r"^img1-([0-9a-f]{64})-([0-9a-f]{8,64})-px(\d+)-(\d+)$")


@dataclass(slots=True, frozen=True, order=True)
class ResolutionPolicy:
    """How a page image is resized before the vision encoder: the processor's pixel bounds."""

    min_pixels: int
    max_pixels: int

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"resolution policy needs 0 < min_pixels <= max_pixels, got {self.min_pixels}, "
                f"{self.max_pixels}; set MMRAG_MIN_PIXELS / MMRAG_MAX_PIXELS accordingly"
            )

    def __str__(self) -> str:
        return f"px{self.min_pixels}-{self.max_pixels}"


@dataclass(slots=True, frozen=True, order=True)
class ImageKey:
    """(content hash, encoder version, resolution policy): the identity of one page's image tokens."""

    content_hash: ContentHash
    encoder_version: EncoderVersion
    policy: ResolutionPolicy

    def __post_init__(self) -> None:
        if not _HEX64.match(self.content_hash):
            raise ValueError(f"content_hash must be 64 lowercase hex chars, got {self.content_hash!r}")
        if not _HEX.match(self.encoder_version):
            raise ValueError(f"encoder_version must be 8-64 hex chars, got {self.encoder_version!r}")

    def __str__(self) -> str:
        return f"img1-{self.content_hash}-{self.encoder_version}-{self.policy}"

    @classmethod
    def parse(cls, text: str) -> ImageKey:
        """Inverse of ``str()``."""
        m = _KEY_RE.match(text)
        if m is None:
            raise ValueError(f"not an image key: {text!r} (expected img1-<sha256>-<encoder>-px<min>-<max>)")
        content, encoder, lo, hi = m.groups()
        return cls(ContentHash(content), EncoderVersion(encoder), ResolutionPolicy(int(lo), int(hi)))


def content_hash_of(mode: str, size: tuple[int, int], pixels: bytes) -> ContentHash:
    """SHA-256 over the normalised image: its mode, size and raw pixel bytes (not the file bytes)."""
    h = hashlib.sha256()
    h.update(f"{mode}:{size[0]}x{size[1]}:".encode())
    h.update(pixels)
    return ContentHash(h.hexdigest())


_POINT_NS = uuid.UUID("6f1c1f52-6b5a-4d59-9a57-3a3f1f0f2b7e")


def doc_id_for(path: str) -> str:
    """Stable document id from the resolved path of the source file."""
    return hashlib.sha256(path.encode()).hexdigest()[:16]


def page_point_id(doc_id: str, page: int) -> str:
    """The Qdrant point id of one page of one document (Qdrant wants a UUID or an int)."""
    return str(uuid.uuid5(_POINT_NS, f"{doc_id}/{page}"))
