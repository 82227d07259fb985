"""Image tokens for a plan, loaded from the FeatureStore — the engine never re-encodes an ingested page."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from adapters.store import FeatureStore, ScopedFeatureStore
from core.keys import ImageKey, ResolutionPolicy, Tiers
from core.pages import EncodedImage
from core.payload import EncoderScope


class MissingFeaturesError(LookupError):
    """A plan names an image whose tokens are not stored."""


class FeatureProvider:
    """``tiers``: stores for keys of other resolution policies (tiers), by policy; every other key is read from
    ``store``."""

    def __init__(self, store: FeatureStore, *, tiers: Mapping[ResolutionPolicy, FeatureStore] | None = None) -> None:
        self.store = store
        self.tiers = dict(tiers or {})

    @classmethod
    def scoped(cls, store: FeatureStore, scope: EncoderScope, tiers: Tiers) -> FeatureProvider:
        """Reads only keys of the configured encoder, under its policy or any configured tier's: tokens of
        another encoder are refused whatever names them, those of another tier of this encoder are served."""
        return cls(ScopedFeatureStore(store, scope), tiers={
            p: ScopedFeatureStore(store, EncoderScope(scope.version, p))
            for p in tiers.policies.values() if p != scope.policy
        })

    async def load(self, keys: Sequence[ImageKey]) -> list[EncodedImage]:
        """The stored tokens of each key, in order (no vision forward: serving only reads what ingestion stored)."""
        # Store reads are blocking I/O (disk or Redis): keep them off the event loop.
        return await asyncio.to_thread(self._load_sync, list(keys))

    def _load_sync(self, keys: list[ImageKey]) -> list[EncodedImage]:
        out = []
        for key in keys:
            value = self.tiers.get(key.policy, self.store).get(key)
            if value is None:
                raise MissingFeaturesError(
                    f"no stored image tokens for {key}; run `mmrag ingest` on its document first"
                )
            out.append(value)
        return out
