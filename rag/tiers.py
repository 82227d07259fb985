"""A question's resolution tier: its retrieved pages' image tokens under the tier it asks for.

Indexed pages carry the key of the ``standard`` tier; their tokens in another tier are looked up under the same
content hash and encoder with that tier's policy (``ImageKey.in_policy``). A page whose tokens in the asked tier
are not stored yet is encoded on demand, once, from its source file (the page image is at hand: the index names
the file and page; a figure shown as its crop is cropped from it again), and the forward is counted in the
answer's ``usage.vision_encodes``. What an encoder makes is stored under that encoder's own key (``key_for``),
through a store scoped to it: the key names the encoder that made the tokens, not the one the index names. Only
when it cannot be (its source is gone or renders another image, or the tower is not in this process:
MMRAG_VISION_URL) does the page fall back to the nearest tier whose tokens are stored, and the answer says so
(``tier.fell_back``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from mmrag.adapters.store import ScopedFeatureStore
from mmrag.core.keys import ContentHash, ImageKey, ResolutionPolicy, Tiers
from mmrag.core.pages import EncodedImage
from mmrag.core.payload import EncoderScope
from mmrag.core.settings import DocumentSettings
from retrieval.search import Hit

if TYPE_CHECKING:
    from PIL import Image

    from mmrag.adapters.store import FeatureStore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TieredHits:
    hits: list[list[Hit]]  # each hit's image key and token count in the asked tier (or its fallback's)
    vision_encodes: int = 0  # pages encoded on demand for it
    fell_back: list[str] = field(default_factory=list)  # `[doc, page N]: <tier> (<why>)` per page served in another


class TierSource(Protocol):
    """What the pipeline asks: ``hits`` with their pages' tokens in ``tier``, stored by the time it returns."""

    def check(self, tier: str) -> None:
        """Raise UnknownTierError, naming the configured tiers, for a tier that is not one."""

    async def __call__(self, hits: Sequence[Sequence[Hit]], tier: str) -> TieredHits: ...


class TierEncoder(Protocol):
    version: str
    policy: ResolutionPolicy

    def key_for(self, content_hash: ContentHash) -> ImageKey: ...

    def encode(self, images: list[Image.Image]) -> list[EncodedImage]: ...


class PageUnavailableError(LookupError):
    """A page's image cannot be rendered as it was indexed: why, for the answer's ``tier.fell_back``."""


class PageTiers:
    """:class:`TierSource` over the feature store, rendering pages with ingestion's loaders.

    ``encoder_for(policy)``: the vision encoder under a tier's policy, or None when pages cannot be encoded in
    this process (then every missing page falls back). Encodes run one at a time (pdfium renders from one
    thread; a second question asking for the same page finds it stored).
    """

    def __init__(self, tiers: Tiers, documents: DocumentSettings, store: FeatureStore,
                 encoder_for: Callable[[ResolutionPolicy], TierEncoder | None]) -> None:
        self.tiers = tiers
        self.store = store
        self._encoder_for = encoder_for
        self.documents = documents  # how ingestion read the pages, to render them again
        self._lock = threading.Lock()
        # Stored entries are content-addressed, so a key's token count never changes.
        self._stored_tokens = functools.lru_cache(maxsize=65_536)(self._read_tokens)

    def check(self, tier: str) -> None:
        self.tiers.policy(tier)

    async def __call__(self, hits: Sequence[Sequence[Hit]], tier: str) -> TieredHits:
        return await asyncio.to_thread(self._retier, hits, self.tiers.policy(tier))

    def _retier(self, hits: Sequence[Sequence[Hit]], policy: ResolutionPolicy) -> TieredHits:
        pages = {h.image_key: h for hs in hits for h in hs if h.image_key.policy != policy}
        result = TieredHits([list(hs) for hs in hits])
        served: dict[ImageKey, tuple[ImageKey, int]] = {}
        missing = []
        for key, hit in pages.items():
            want = key.in_policy(policy)
            if self.store.contains(want):
                served[key] = (want, self._stored_tokens(want))
            else:
                missing.append(hit)
        if missing:
            with self._lock:
                served |= self._encode(missing, policy, result)
        result.hits = [[dataclasses.replace(h, image_key=served[h.image_key][0], image_tokens=served[h.image_key][1])
                        if h.image_key in served else h for h in hs] for hs in hits]
        return result

    def _encode(self, hits: list[Hit], policy: ResolutionPolicy, result: TieredHits
                ) -> dict[ImageKey, tuple[ImageKey, int]]:
        encoder = self._encoder_for(policy)
        images: dict[ImageKey, Image.Image] = {}
        served: dict[ImageKey, tuple[ImageKey, int]] = {}
        for hit in hits:
            content = hit.image_key.content_hash
            want = hit.image_key.in_policy(policy) if encoder is None else encoder.key_for(content)
            if self.store.contains(want):  # another question encoded it while this one waited
                served[hit.image_key] = (want, self._stored_tokens(want))
                continue
            try:
                if encoder is None:
                    raise PageUnavailableError("pages are encoded by the vision service (MMRAG_VISION_URL), which "
                                               "encodes the standard tier only")
                images[hit.image_key] = self._render(hit)
            except PageUnavailableError as exc:
                served[hit.image_key] = self._fallback(hit, policy, str(exc), result)
        if images:
            writer = ScopedFeatureStore(self.store, EncoderScope(encoder.version, encoder.policy))
            for key, value in zip(images, encoder.encode(list(images.values())), strict=True):
                mine = encoder.key_for(key.content_hash)
                writer.put(mine, value)
                served[key] = (mine, value.num_tokens)
            result.vision_encodes += len(images)
        return served

    def _render(self, hit: Hit) -> Image.Image:
        """The image ``hit`` shows, rendered from its source as ingestion rendered it: its page, or, for a figure
        shown as its crop (rag/plans.shown_as_figures), that figure's crop of the page."""
        from ingestion.loaders import IngestError, render_page

        crop = hit.shows_crop
        documents = replace(self.documents, figures=crop)  # a page's figures are not cropped for it
        try:
            rendered = render_page(Path(hit.path), hit.page, documents)
        except IngestError as exc:
            raise PageUnavailableError(f"its source file cannot be opened: {exc}") from exc
        if rendered is not None and crop:
            found = next((c.image for c in rendered.figures if c.content_hash == hit.image_key.content_hash), None)
            if found is None:
                raise PageUnavailableError(f"its source file changed since it was indexed: no crop of "
                                           f"{hit.figure.label} on the page matches")
            return found
        if rendered is None or rendered.content_hash != hit.image_key.content_hash:
            raise PageUnavailableError("its source file changed since it was indexed")
        return rendered.image

    def _fallback(self, hit: Hit, asked: ResolutionPolicy, why: str, result: TieredHits) -> tuple[ImageKey, int]:
        stored = [p for p in self.tiers.policies.values() if self.store.contains(hit.image_key.in_policy(p))]
        policy = Tiers.nearest(asked, stored) if stored else hit.image_key.policy
        key = hit.image_key.in_policy(policy)
        note = f"[{hit.doc}, page {hit.page}]: {self.tiers.name_of(policy)} ({why})"
        log.warning("tier %s not available for %s", self.tiers.name_of(asked), note)
        result.fell_back.append(note)
        return key, hit.image_tokens if key == hit.image_key else self._stored_tokens(key)

    def _read_tokens(self, key: ImageKey) -> int:
        value = self.store.get(key)
        if value is None:
            raise LookupError(f"image tokens {key} vanished from the feature store while a question used them")
        return value.num_tokens
