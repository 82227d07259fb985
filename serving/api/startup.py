"""Build the services at start-up: engine, pipeline + scheduler, metrics, ingest jobs, then warm-up."""

from __future__ import annotations

import asyncio
import logging

from core.keys import ImageKey
from core.settings import Settings
from ingestion.embed import clip_embed_dim
from ingestion.index import PageIndex
from ingestion.model_source import resolve_model
from ingestion.pipeline import Ingestor
from ingestion.vision import VisionEncoder
from rag.pipeline import open_pipeline
from serving.api.services import MeteredEngine, Services
from serving.engine.factory import open_engine
from serving.ingest_jobs import IngestJobs, LoopBridge
from serving.metrics import Metrics
from serving.warmup import rank_by_demand, warm

log = logging.getLogger("mmrag.api")


async def build_services(settings: Settings, *, metrics: Metrics, engine=None) -> Services:
    model = resolve_model(settings)
    owns_engine = engine is None
    # Started on the loop thread: vLLM's async engine binds to the loop that first drives it.
    raw = engine if engine is not None else open_engine(settings, model)
    metered = MeteredEngine(raw, metrics)
    pipeline = open_pipeline(settings, metered)
    store = raw.features.store
    metrics.register_store(store)
    if settings.engine_url_list:
        metrics.register_remote_replicas(settings.engine_url_list)
    loop = asyncio.get_running_loop()

    def make_ingestor() -> Ingestor:
        searcher = pipeline.searcher
        index = PageIndex(LoopBridge(searcher.client, loop), settings.qdrant_collection,
                          text_dim=searcher.text_embedder.dim, image_dim=clip_embed_dim(settings.clip_model))
        index.ensure_collection()
        encoder = VisionEncoder(model.path, settings.resolution_policy, salt=settings.encoder_salt)
        return Ingestor(settings, encoder=encoder, store=store, index=index, text_embedder=searcher.text_embedder,
                        image_embedder=searcher.image_embedder)

    services = Services(settings=settings, model=model, engine=metered, pipeline=pipeline, store=store,
                        metrics=metrics, jobs=IngestJobs(settings.ingest_root, make_ingestor), owns_engine=owns_engine)
    services.start_metrics_drain()
    if settings.warm_top != 0:
        await warm_at_startup(services)
    return services


async def warm_at_startup(services: Services) -> None:
    """Fill the serving engine's prefix cache with the most recurring pages that fit its KV share."""
    pages = await indexed_image_pages(services)
    if not pages:
        return
    candidates = rank_by_demand(pages)
    top = services.settings.warm_top
    # The unmetered engine: warm-up prefills are misses by design and would drag the hit-rate panels down.
    report = await warm(services.engine.inner, candidates[:top] if top > 0 else candidates)
    services.warm_report = report
    services.metrics.set_warm_set(len(report.warmed), report.warmed_tokens)
    log.info("warmed %d pages (%d image tokens) in %.1fs; %d did not fit", len(report.warmed),
             report.warmed_tokens, report.seconds, len(report.did_not_fit))


async def indexed_image_pages(services: Services) -> list[tuple[ImageKey, int]]:
    client, collection = services.qdrant, services.settings.qdrant_collection
    if not await client.collection_exists(collection):
        return []
    out, offset = [], None
    while True:
        points, offset = await client.scroll(collection, limit=512, offset=offset,
                                             with_payload=["image_key", "image_tokens"])
        out += [(ImageKey.parse(p.payload["image_key"]), p.payload["image_tokens"]) for p in points]
        if offset is None:
            return out
