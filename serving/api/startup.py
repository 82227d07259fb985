"""Start-up work once the services are built: warm the serving engine's prefix cache."""

from __future__ import annotations

import logging

from serving.api.services import Services
from serving.warmup import rank_by_demand, warm

log = logging.getLogger(__name__)


async def warm_at_startup(services: Services) -> None:
    """Fill the serving engine's prefix cache with the most recurring pages that fit its KV share. Only pages
    the configured encoder made: the tokens of another one are never fed (build_services warned of them)."""
    encoder = services.pipeline.searcher.encoder
    pages = [p for p in await services.pages.pages() if encoder is None or encoder.covers(p.image_key)]
    if not pages:
        log.info("warm-up skipped: no pages of the configured encoder are indexed")
        return
    candidates = rank_by_demand((p.image_key, p.image_tokens) for p in pages)
    top = services.settings.warm_top
    # The unmetered engine: warm-up prefills are misses by design and would drag the hit-rate panels down.
    report = await warm(services.engine.inner, candidates[:top] if top > 0 else candidates)
    services.warm_report = report
    services.metrics.set_warm_set(len(report.warmed), report.warmed_tokens)  # warm() logs the summary
