"""Image tokens for a plan, loaded from the FeatureStore — the engine never re-encodes an ingested page."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from mmrag.adapters.store import FeatureStore, ScopedFeatureStore
from mmrag.core.keys import ImageKey, ResolutionPolicy, Tiers
from mmrag.core.pages import EncodedImage
from mmrag.core.payload import EncoderScope


class MissingFeaturesError(LookupError):
    """A plan names an image whose tokens are not stored: a page never ingested (or its document deleted), or a
    question's image whose tokens went (the API answers that one as `image_expired`: send it again)."""


class FeatureProvider:
    """Reads the tokens of one encoder only (``scope``: its version under its policy, or under one of ``tiers``):
    a key of another encoder is refused, whatever named it, before the store is read.

    The scope is required: an engine cannot tell stale tokens from fresh ones by looking at them, so a provider
    that served any key would feed a page ingested before an upgrade without a word. None is an explicit choice
    (:meth:`unscoped`), never a default. ``store`` is the store read; each load reads it through a
    :class:`ScopedFeatureStore`, so the scope holds whichever store is set."""

    def __init__(self, store: FeatureStore, scope: EncoderScope | None, *,
                 tiers: Iterable[ResolutionPolicy] = ()) -> None:
        self.store = store
        self.scope = scope
        self.tiers = frozenset(tiers)

    @classmethod
    def scoped(cls, store: FeatureStore, scope: EncoderScope, tiers: Tiers) -> FeatureProvider:
        """The engines' provider: the configured encoder's tokens under its policy or any configured tier's."""
        return cls(store, scope, tiers=tiers.policies.values())

    @classmethod
    def unscoped(cls, store: FeatureStore) -> FeatureProvider:
        """Serves any encoder's keys: for an engine fed several encoders' keys on purpose (the engine tests check
        that each gets caches of its own) or only keys its caller just minted (benchmarks). Nothing that serves
        questions uses it: nothing here would stop stale tokens (tests/test_key_owner.py checks)."""
        return cls(store, None)

    async def load(self, keys: Sequence[ImageKey]) -> list[EncodedImage]:
        """The stored tokens of each key, in order (no vision forward: serving only reads what ingestion stored)."""
        # Store reads are blocking I/O (disk or Redis): keep them off the event loop.
        return await asyncio.to_thread(self._load_sync, list(keys))

    def _load_sync(self, keys: list[ImageKey]) -> list[EncodedImage]:
        reader = self.store if self.scope is None else ScopedFeatureStore(self.store, self.scope, tiers=self.tiers)
        out = []
        for key in keys:
            value = reader.get(key)
            if value is None:
                raise MissingFeaturesError(
                    f"no stored image tokens for {key}: if it is a page's, run `mmrag ingest` on its document; if "
                    "an image sent with a question (or its conversation), send the image again"
                )
            out.append(value)
        return out
