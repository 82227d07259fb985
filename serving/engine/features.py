"""Image tokens for a plan, loaded from the FeatureStore — the engine never re-encodes an ingested page."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from core.keys import ImageKey
from core.pages import EncodedImage
from adapters.store import FeatureStore


class MissingFeaturesError(LookupError):
    """A plan names an image whose tokens are not stored."""


class FeatureProvider:
    def __init__(self, store: FeatureStore) -> None:
        self.store = store

    async def load(self, keys: Sequence[ImageKey]) -> list[EncodedImage]:
        """The stored tokens of each key, in order (no vision forward: serving only reads what ingestion stored)."""
        # Store reads are blocking I/O (disk or Redis): keep them off the event loop.
        return await asyncio.to_thread(self._load_sync, list(keys))

    def _load_sync(self, keys: list[ImageKey]) -> list[EncodedImage]:
        out = []
        for key in keys:
            value = self.store.get(key)
            if value is None:
                raise MissingFeaturesError(
                    f"no stored image tokens for {key}; run `mmrag ingest` on its document first"
                )
            out.append(value)
        return out
