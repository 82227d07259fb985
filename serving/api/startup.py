"""Start-up work once the services are built: warm the serving engine's prefix cache, then take what start-up
built out of the garbage collector's way."""

from __future__ import annotations

import gc
import logging

from serving.api.services import Services
from serving.warmup import leading_images, rank_by_demand, warm, warm_plan

log = logging.getLogger(__name__)


async def warm_at_startup(services: Services) -> None:
    """Fill the serving engine's prefix cache with the most recurring pages (and, with MMRAG_FIGURE_CROPS, figure
    crops) that fit its KV share, each tenant's with its cache salt and an equal part of the share (a tenant's
    warmed KV serves only it). Only images the configured encoder made: the tokens of another one are never fed
    (build_services warned)."""
    views = list(services.tenants.values())  # none: a tenants file without tenants serves nobody
    warmed = tokens = 0
    for view in views:
        encoder = view.pipeline.searcher.encoder
        pages = [p for p in await view.pages.pages() if encoder is None or encoder.covers(p.image_key)]
        if not pages:
            log.info("warm-up skipped for tenant %s: no pages of the configured encoder are indexed", view.tenant)
            continue
        candidates = rank_by_demand(leading_images(pages, figure_crops=services.settings.figure_crops,
                                                   by_pixels=services.settings.page_image_channel))
        top = services.settings.warm_top
        # The unmetered engine: warm-up prefills are misses by design and would drag the hit-rate panels down.
        report = await warm(services.engine.inner, candidates[:top] if top > 0 else candidates,
                            share=0.5 / len(views), cache_salt=view.scope.cache_salt)
        view.warm_report = report
        for key in report.warmed:  # the scheduler sees no warm-up prefill itself: a warm page is never gated
            services.scheduler.note_prefilled(warm_plan(key, view.scope.cache_salt))
        if services.scheduler.residency is not None:  # nor does its KV estimate
            tokens_of = {c.key: c.image_tokens for c in candidates}
            for key in report.warmed:
                services.scheduler.residency.observe((key,), [tokens_of[key]])
        warmed, tokens = warmed + len(report.warmed), tokens + report.warmed_tokens
    services.metrics.set_warm_set(warmed, tokens)  # warm() logs each tenant's summary


def freeze_heap() -> int:
    """Move every object alive now to the collector's permanent generation; return how many are there.

    A server that imported torch, transformers and vLLM and built its engine, indexes and models tracks about a
    million objects, and they live until it stops. A full collection walks them all (0.5 s and more on these
    CPUs) and stops every request of the event loop meanwhile, at a point no request chooses: a stall in some
    first tokens. Frozen, they are skipped, and a full collection walks what serving itself makes. vLLM's own
    servers do the same after start-up (vllm/utils/gc_utils.freeze_gc_heap). Collected first, so what start-up
    left as garbage is freed rather than kept."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
