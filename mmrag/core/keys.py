"""The one typed key for image tokens, and the page identifiers derived in one place.

Every component that names cached image tokens or KV — ingestion, the feature store, the engine's
``multi_modal_uuids``, warm-up and metrics — uses :class:`ImageKey` and its ``str()`` form. vLLM uses the
uuid *verbatim* as the cache key of the image (it replaces the content hash), so the string must carry
everything that changes the tokens: the page content, the encoder and the resolution policy (pooling included).
:class:`Tiers` names the configured policies (resolution tiers): one page has a key per tier it is stored in.

Only encoders mint keys (``VisionEncoder.key_for`` / ``RemoteVisionEncoder.key_for``): a key names the encoder
that made its tokens, so one made anywhere else could file one encoder's tokens under another's version, where
the first writer wins. Everything else reads keys back (:meth:`ImageKey.parse`) or looks stored tokens up
(:meth:`ImageKey.in_policy`); tests/test_key_owner.py holds the source tree to it.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import NewType, Protocol

ContentHash = NewType("ContentHash", str)  # sha256 hex of the rendered, normalised page image
EncoderVersion = NewType("EncoderVersion", str)  # hex digest of vision weights + processor config + salt

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX = re.compile(r"^[0-9a-f]{8,64}$")
_KEY_RE = re.compile(r"^img1-([0-9a-f]{64})-([0-9a-f]{8,64})-px(\d+)-(\d+)(?:-pool(\d+))?$")


@dataclass(slots=True, frozen=True, order=True)
class ResolutionPolicy:
    """How a page image becomes tokens: the processor's pixel bounds, and ``pool``, the side of the square of
    merged tokens averaged into one after the projector (1: none; 2: 2x2, a quarter of the tokens, the grid kept
    so that M-RoPE positions stay consistent, mmrag/adapters/vision.py ``pool_grid``)."""

    min_pixels: int
    max_pixels: int
    pool: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"resolution policy needs 0 < min_pixels <= max_pixels, got {self.min_pixels}, "
                f"{self.max_pixels}; set MMRAG_MIN_PIXELS / MMRAG_MAX_PIXELS (or the tier in MMRAG_TIERS) accordingly"
            )
        if self.pool not in (1, 2):
            raise ValueError(f"pool must be 1 (none) or 2 (2x2 pooling), got {self.pool}; fix it in MMRAG_TIERS")

    @property
    def pooled(self) -> bool:
        return self.pool > 1

    @property
    def token_budget(self) -> float:
        """max_pixels over pool²: proportional to the most image tokens a page takes under this policy (what
        :meth:`Tiers.nearest` compares)."""
        return self.max_pixels / self.pool**2

    def __str__(self) -> str:
        # Unpooled keys keep the form they had before pooling existed, so stored keys stay valid.
        return f"px{self.min_pixels}-{self.max_pixels}" + (f"-pool{self.pool}" if self.pooled else "")


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
            raise ValueError(
                f"not an image key: {text!r} (expected img1-<sha256>-<encoder>-px<min>-<max>[-pool<n>])")
        content, encoder, lo, hi, pool = m.groups()
        policy = ResolutionPolicy(int(lo), int(hi), int(pool) if pool else 1)
        if pool is not None and not policy.pooled:  # -pool1 is not a form str() writes: one key, one string
            raise ValueError(f"not an image key: {text!r} (an unpooled key has no -pool part)")
        return cls(ContentHash(content), EncoderVersion(encoder), policy)

    def in_policy(self, policy: ResolutionPolicy) -> ImageKey:
        """The same page from the same encoder under another policy (another tier): a lookup of what that encoder
        stored, never a key to store under (that is the encoder's ``key_for``: the store refuses other keys)."""
        return replace(self, policy=policy)


STANDARD_TIER = "standard"  # MMRAG_MIN_PIXELS / MMRAG_MAX_PIXELS: the tier whose keys indexed pages carry
OTHER_TIER = "other"  # the tier label of a policy no configured tier has


class KeyLease(Protocol):
    """One holder's lease on stored image tokens (mmrag/adapters/store.py ``StoreLease``): while it lasts, no deletion
    (a document's, ``mmrag store gc``) removes the entries, in any process sharing the store. An answer holds
    one on its pages from retrieval to its last token; a conversation on its images while it lives."""

    def take(self, keys: Iterable[ImageKey]) -> set[ImageKey]:
        """Lease ``keys`` (or renew them); those of them no longer stored (deleted before the lease began)."""
        ...

    def end(self) -> None:
        """Release every key this lease took."""
        ...


class NoLease:
    """A lease that holds nothing: for a store nothing deletes from (tests, benchmarks)."""

    def take(self, keys: Iterable[ImageKey]) -> set[ImageKey]:
        return set()

    def end(self) -> None:
        pass


class UnknownTierError(ValueError):
    """A tier that is not configured; the message names the configured ones."""


@dataclass(slots=True, frozen=True)
class Tiers:
    """The named resolution tiers (MMRAG_TIERS plus ``standard``): what a question or ingest asks for by name,
    and what metrics label image tokens with."""

    policies: Mapping[str, ResolutionPolicy]

    def policy(self, name: str) -> ResolutionPolicy:
        try:
            return self.policies[name]
        except KeyError:
            raise UnknownTierError(
                f"unknown resolution tier {name!r}; configured tiers: {', '.join(self.policies)} (MMRAG_TIERS)"
            ) from None

    def name_of(self, policy: ResolutionPolicy) -> str:
        """The first tier with this policy, else ``other`` (tokens of a policy no longer configured)."""
        return next((n for n, p in self.policies.items() if p == policy), OTHER_TIER)

    def labels(self, key: ImageKey) -> dict[str, str]:
        """Metric labels of a key's image tokens: its tier and whether they are pooled."""
        return {"tier": self.name_of(key.policy), "pooled": str(key.policy.pooled).lower()}

    def in_use(self, indexed: Iterable[ImageKey]) -> Callable[[ImageKey], bool]:
        """Whether a stored key is in use, given the keys indexed pages carry: one of them, or the same page
        and encoder in a configured tier (tier entries live in the store only; a garbage collector keeps them)."""
        exact = set(indexed)
        pages = {(k.content_hash, k.encoder_version) for k in exact}
        policies = set(self.policies.values())
        return lambda key: key in exact or (
            (key.content_hash, key.encoder_version) in pages and key.policy in policies)

    @staticmethod
    def nearest(asked: ResolutionPolicy, have: list[ResolutionPolicy]) -> ResolutionPolicy:
        """Of ``have``, the policy closest to ``asked`` in tokens per page (log ratio: 2x more is as far as 2x
        fewer); on a tie, the larger one (a fallback should not lose detail it need not lose)."""
        return min(have, key=lambda p: (abs(math.log(p.token_budget / asked.token_budget)),
                                        -p.token_budget))


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


def figure_point_id(page_id: str, index: int) -> str:
    """The Qdrant point id of a page's ``index``-th figure (mmrag/core/payload.py PageField.KIND)."""
    return str(uuid.uuid5(_POINT_NS, f"{page_id}/figure/{index}"))
