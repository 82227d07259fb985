"""Warm-up: prefill-only requests that leave chosen pages' image prefixes in the engine's KV cache.

Which pages: by expected demand — how often a page image recurs across the corpus (the architecture
diagram in three decks is asked about three times as often) — or an explicit list. With figure crops in prompts
(MMRAG_FIGURE_CROPS), a page's figures lead prompts too: their crops are candidates beside the pages, and a chart
pasted into three documents is one crop of demand three. How many: as many as
fit in the share of the engine's KV capacity we allow warm-up to take; the rest is reported, not dropped
silently. Each warm request is the plan ``[system][image][""]`` with max_tokens=1, whose full blocks are
exactly the prefix every later canonical plan starting with that image shares.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from mmrag.adapters.lexical import caption_terms
from mmrag.core.keys import ImageKey
from mmrag.core.engine import Engine, KVCapacity, PromptPlan, SamplingSpec
from mmrag.core.figures import leading_crops
from mmrag.core.payload import PagePayload

log = logging.getLogger(__name__)

WARM_SAMPLING = SamplingSpec(max_tokens=1)


@dataclass(slots=True, frozen=True)
class WarmCandidate:
    key: ImageKey
    image_tokens: int
    demand: int  # pages in the corpus that show this image


@dataclass(slots=True)
class WarmReport:
    warmed: list[ImageKey] = field(default_factory=list)
    did_not_fit: list[ImageKey] = field(default_factory=list)
    warmed_tokens: int = 0
    budget_tokens: int = 0
    seconds: float = 0.0

    @property
    def pages_per_s(self) -> float:
        return len(self.warmed) / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return {
            "warmed": [str(k) for k in self.warmed],
            "did_not_fit": [str(k) for k in self.did_not_fit],
            "warmed_tokens": self.warmed_tokens,
            "budget_tokens": self.budget_tokens,
            "seconds": round(self.seconds, 3),
            "pages_per_s": round(self.pages_per_s, 2),
        }


def leading_images(pages: Iterable[PagePayload], *, figure_crops: bool, by_pixels: bool = False
                   ) -> Iterator[tuple[ImageKey, int]]:
    """(image key, image tokens) of every image a prompt over ``pages`` can lead with, once per occurrence (the
    demand :func:`rank_by_demand` counts): each page's image and, with ``figure_crops`` (a hit on a figure is shown
    as its crop: rag/plans.shown_as_figures), the crops of its figures that a hit can name (mmrag/core/figures.py
    leading_crops: those a question's words name, and with a page-image channel finding crops by their pixels,
    ``by_pixels``: Settings.page_image_channel, every one)."""
    for page in pages:
        yield page.image_key, page.image_tokens
        if figure_crops:
            yield from ((f.image_key, f.image_tokens)
                        for f in leading_crops(page, by_pixels=by_pixels, terms=caption_terms))


def rank_by_demand(pages: Iterable[tuple[ImageKey, int]]) -> list[WarmCandidate]:
    """``pages``: (image key, image tokens) per indexed page. Most recurring first; ties by key."""
    counts: Counter[ImageKey] = Counter()
    tokens: dict[ImageKey, int] = {}
    for key, n in pages:
        counts[key] += 1
        tokens[key] = n
    return sorted((WarmCandidate(k, tokens[k], c) for k, c in counts.items()), key=lambda c: (-c.demand, c.key))


def fit_to_capacity(
    candidates: list[WarmCandidate], capacity: KVCapacity, *, prefix_tokens: int, share: float
) -> tuple[list[WarmCandidate], list[WarmCandidate]]:
    """Greedy in demand order: each page costs its prompt's blocks (system prefix + image, rounded up).

    The system prefix is shared by all of them, but it is charged per page anyway: the bound stays safe
    whatever the engine evicts first.
    """
    budget_blocks = int(capacity.blocks * share)
    chosen, rest, used = [], [], 0
    for cand in candidates:
        cost = math.ceil((prefix_tokens + cand.image_tokens) / capacity.block_size)
        if used + cost <= budget_blocks:
            chosen.append(cand)
            used += cost
        else:
            rest.append(cand)
    return chosen, rest


async def warm(engine: Engine, candidates: list[WarmCandidate], *, share: float = 0.5, prefix_tokens: int = 64,
               concurrency: int = 4, cache_salt: str = "") -> WarmReport:
    """Prefill the chosen pages under ``cache_salt`` (the tenant's whose pages they are: its questions hit
    them, nobody else's)."""
    capacity = await engine.kv_capacity()
    chosen, rest = fit_to_capacity(candidates, capacity, prefix_tokens=prefix_tokens, share=share)
    report = WarmReport(did_not_fit=[c.key for c in rest], budget_tokens=int(capacity.tokens * share))
    gate = asyncio.Semaphore(concurrency)
    started = time.perf_counter()

    async def one(cand: WarmCandidate) -> None:
        async with gate:
            await engine.generate(warm_plan(cand.key, cache_salt))

    await asyncio.gather(*(one(c) for c in chosen))
    report.seconds = time.perf_counter() - started
    report.warmed = [c.key for c in chosen]
    report.warmed_tokens = sum(c.image_tokens for c in chosen)
    log.info("warm-up: %d pages (%d image tokens) in %.1f s, %.1f pages/s; %d did not fit the %d-token budget "
             "(share %.2f of %d KV tokens)", len(report.warmed), report.warmed_tokens, report.seconds,
             report.pages_per_s, len(report.did_not_fit), report.budget_tokens, share, capacity.tokens)
    return report


def warm_plan(key: ImageKey, cache_salt: str = "") -> PromptPlan:
    return PromptPlan(images=(key,), text="", sampling=WARM_SAMPLING, cache_salt=cache_salt)
