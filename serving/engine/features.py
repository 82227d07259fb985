"""Image tokens for a plan, loaded from the FeatureStore — the engine never re-encodes an ingested page."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from core.keys import ImageKey
from core.pages import EncodedImage
from ingestion.store import FeatureStore


class MissingFeaturesError(LookupError):
    """A plan names an image whose tokens are not stored and cannot be re-made here."""


# Re-creates a missing entry (render the page again + one vision forward); None when it cannot.
Reencoder = Callable[[ImageKey], EncodedImage | None]


class FeatureProvider:
    def __init__(self, store: FeatureStore, reencode: Reencoder | None = None) -> None:
        self.store = store
        self.reencode = reencode

    async def load(self, keys: Sequence[ImageKey]) -> tuple[list[EncodedImage], int]:
        """The tokens of each key, in order, and how many vision forwards that took."""
        # Store reads are blocking I/O (disk or Redis): keep them off the event loop.
        return await asyncio.to_thread(self._load_sync, list(keys))

    def _load_sync(self, keys: list[ImageKey]) -> tuple[list[EncodedImage], int]:
        out, encodes = [], 0
        for key in keys:
            value = self.store.get(key)
            if value is None and self.reencode is not None:
                value = self.reencode(key)
                if value is not None:
                    self.store.put(key, value)
                    encodes += 1
            if value is None:
                raise MissingFeaturesError(
                    f"no stored image tokens for {key}; run `mmrag ingest` on its document first"
                )
            out.append(value)
        return out, encodes
