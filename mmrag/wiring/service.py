"""The REST service: `mmrag serve` in one process (vLLM and the vision tower in it), or split across services
(MMRAG_ENGINE_URLS: `vllm serve` replicas; MMRAG_VISION_URL: the vision service): the same builder, its parts
remote where the settings name them."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING

from mmrag.core.engine import Engine
from mmrag.core.payload import pages_per_encoder
from mmrag.core.settings import DEFAULT_TENANT, Settings
from mmrag.wiring.parts import (
    encoder_scope, feature_store, ingestor, model_family, page_index, resolve_model, searcher, vision_tower,
)
from mmrag.wiring.answering import answer_cache, engine, pipeline, scoped_pipeline, tenant_scope

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mmrag.adapters.qdrant import PageIndex
    from mmrag.adapters.store import FeatureStore
    from mmrag.core.scope import TenantScope
    from ingestion.pipeline import Ingestor
    from serving.api.conversations import Conversations
    from serving.api.services import Services
    from serving.ingest_jobs import IngestJobs
    from serving.metrics import Metrics

log = logging.getLogger(__name__)


# --- the REST service ------------------------------------------------------------------------------------


async def build_services(settings: Settings, *, metrics: Metrics, engine_: Engine | None = None,
                         store_: FeatureStore | None = None) -> Services:
    """Everything the app serves with, built on the running loop (vLLM's async engine binds to it).

    ``engine_``/``store_``: an already started engine and the feature store it reads (tests share one engine
    per session); the store is what the feature-store metrics count.
    """
    from mmrag.adapters.qdrant import AsyncPageReader, LoopBridge
    from mmrag.adapters.store import StoreLease
    from serving.api.admission import Admission, Share
    from serving.api.limits import RequestRates
    from serving.api.conversations import Conversations
    from serving.api.services import MeteredEngine, QuestionImages, Services
    from serving.api.tenants import TenantKeys
    from serving.engine.remote import RemoteEngine
    from serving.ingest_jobs import IngestJobs

    model = resolve_model(settings)
    log.info("model: %s", model.describe())
    store = store_ or feature_store(settings)
    encoder = encoder_scope(settings, model)
    raw = engine_ if engine_ is not None else engine(settings, model, store, encoder=encoder)
    metered = MeteredEngine(raw, metrics)
    tower = vision_tower(settings, model)
    keys = TenantKeys.from_settings(settings.api_service)
    scopes = {t: tenant_scope(settings, t) for t in {DEFAULT_TENANT, *keys.tenants}}

    def scope_of(tenant: str) -> TenantScope:  # a job resumed for a tenant since removed still has its scope
        return scopes[tenant] if tenant in scopes else tenant_scope(settings, tenant)

    pipe, scheduler = pipeline(settings, metered, scope=scopes[DEFAULT_TENANT], encoder=encoder, store=store,
                               tower=tower, answers=answer_cache(settings, metrics))
    metrics.register_store(store)
    metrics.set_tiers(settings.vision.tier_table)
    if not isinstance(raw, RemoteEngine):  # one prefix cache to model; replicas have their own (left unestimated)
        scheduler.track_kv((await raw.kv_capacity()).tokens)
    await scheduler.fit()  # MMRAG_MAX_CONCURRENCY=0: the engine's batch, asked now rather than on a question
    await pipe.searcher.stale_pages()  # warns at start-up when pages of another encoder are indexed
    reader = AsyncPageReader(pipe.searcher.client, settings.storage.qdrant_collection)
    metrics.set_encoder(encoder, model_family(model), pages_per_encoder(await reader.pages()))
    if settings.engine.urls:
        metrics.register_remote_replicas(settings.engine.urls)
    events = getattr(raw, "kv_events", None)  # the remote and the Ray engines' subscriber, when they follow events
    if events is not None:
        metrics.register_kv_events(events.index.stats, events.routed)
    loop = asyncio.get_running_loop()
    client = pipe.searcher.client

    def make_index(tenant: str) -> PageIndex:
        # Local mode allows one Qdrant client per folder: server-side ingest writes through the server's own
        # async client, from the job's worker thread, on this loop.
        late = pipe.searcher.late
        return page_index(settings, pipe.searcher.text_embedder.dim, collection=scope_of(tenant).collection,
                          client=LoopBridge(client, loop), late_dim=late.dim if late else 0)

    def make_ingestor(tenant: str, tiers: tuple[str, ...]) -> Ingestor:
        # ``tiers``: the job's own, beside MMRAG_INGEST_TIERS (checked by the route).
        return ingestor(settings, model=model, store=store, index=make_index(tenant), encoder=tower(),
                        text=pipe.searcher.text_embedder, image=pipe.searcher.image_embedder, tiers=tiers)

    jobs = IngestJobs(scope_of, make_ingestor, state=settings.storage.data_dir / "jobs.sqlite3",
                      make_index=make_index, store=store,
                      referenced=lambda index: index.referenced_keys(settings.storage.qdrant_collection),
                      tiers=settings.vision.tier_table, workers=settings.ingestion.workers,
                      retry_s=settings.storage.delete_retry_s,
                      keep=settings.ingestion.jobs_kept)
    # Each conversation leases its images for as long as it lives (serving/api/conversations.py).
    conversations = Conversations(max_entries=settings.api.max_conversations,
                                  per_tenant=settings.api.conversations_per_tenant,
                                  ttl_s=settings.api.conversation_ttl_s,
                                  lease=functools.partial(StoreLease, store, "conversation",
                                                          settings.api.conversation_ttl_s))
    root = Services(settings=settings.api_service, model=model, engine=metered, pipeline=pipe, scheduler=scheduler,
                    store=store, pages=reader, metrics=metrics, jobs=jobs.for_tenant(DEFAULT_TENANT),
                    owns_engine=engine_ is None, keys=keys, scope=scopes[DEFAULT_TENANT],
                    admission=Admission(settings.api.max_questions_in_flight, queue=settings.api.admission_queue,
                                        max_wait_s=settings.api.admission_max_wait_s, record=metrics.record_answer,
                                        record_wait=metrics.record_admission_wait, tenants=keys.tenants,
                                        shares={t: Share(q.weight, q.questions_in_flight) for t, q in keys.quotas}),
                    question_images=QuestionImages(settings.api_service, store, lambda: tower().view()),
                    conversations=conversations.for_tenant(DEFAULT_TENANT),
                    rates=RequestRates({t: q.requests_per_s for t, q in keys.quotas if q.requests_per_s}))
    root.tenants.update({t: tenant_view(settings, root, scopes[t], jobs, conversations) for t in keys.tenants})
    metrics.set_tenants(keys.tenants)
    return root


def tenant_view(settings: Settings, root: Services, scope: TenantScope, jobs: IngestJobs,
                conversations: Conversations) -> Services:
    """The tenant's services: its own pipeline (its collection searched, its salt on every plan), pages, jobs
    and conversations, all from its scope; engine, scheduler, store, tiers and embedders stay the process's one."""
    import dataclasses

    from mmrag.adapters.qdrant import AsyncPageReader

    if scope.tenant == DEFAULT_TENANT:
        return root
    base = root.pipeline
    search = searcher(settings, collection=scope.collection, client=base.searcher.client,
                      encoder=base.searcher.encoder, text=base.searcher.text_embedder,
                      image=base.searcher.image_embedder)
    pipe = scoped_pipeline(settings, scope, root.engine, submit=base.submit, counts=base.token_counts,
                           tiers=base.tiers, search=search, lease=base.lease, answers=base.answers)
    return dataclasses.replace(root, scope=scope, pipeline=pipe,
                               pages=AsyncPageReader(base.searcher.client, scope.collection),
                               jobs=jobs.for_tenant(scope.tenant),
                               conversations=conversations.for_tenant(scope.tenant),
                               tenants={})


def create_app(settings: Settings, *, engine: Engine | None = None, store: FeatureStore | None = None,
               freeze: bool = False) -> FastAPI:
    """The REST app. ``engine``: an already started engine to share (tests), with the ``store`` it reads;
    otherwise the app starts one over the configured store. ``freeze``: the process is the server's own (`mmrag
    serve`), whose heap is frozen once started (serving/api/startup.freeze_heap); not an app in a test's process."""
    from serving.api.main import create_app as assemble

    async def build(metrics: Metrics) -> Services:
        return await build_services(settings, metrics=metrics, engine_=engine, store_=store)

    return assemble(settings.api_service, build, freeze=freeze)
