"""The app factory: assembles routers, middleware and metrics around services built by the caller
(``mmrag.wiring.create_app`` passes its builder and the REST service's section of the settings, ``Settings.api``;
never built at import)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry

from mmrag.core.settings import ApiSettings
from serving.api.limits import BodySizeLimit, body_allowances, reject_invalid_text
from serving.api.routers import ask, documents, health, ingest, openai, ui
from serving.api.services import Services
from serving.api.slow_clients import BodyReadTimeout
from serving.api.startup import freeze_heap, warm_at_startup
from serving.http import errors
from serving.metrics import Metrics, VllmFromGlobalRegistry

log = logging.getLogger(__name__)


def create_app(settings: ApiSettings, build_services: Callable[[Metrics], Awaitable[Services]], *,
               freeze: bool = False) -> FastAPI:
    """``build_services`` runs in the lifespan, on the serving loop (vLLM's async engine binds to it). ``freeze``:
    the process is this server's own (`mmrag serve`): once started, its heap is frozen (startup.freeze_heap)."""
    # One registry per app (so an app can be built twice in one process), which also re-exports the
    # in-process vLLM engine's own `vllm:*` metrics from the global registry.
    registry = CollectorRegistry()
    registry.register(VllmFromGlobalRegistry())
    metrics = Metrics(registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        services = app.state.services = await build_services(metrics)
        services.start_metrics_drain()
        if settings.warm_top != 0:
            await warm_at_startup(services)
        if freeze:
            log.info("start-up done: %d objects frozen out of the garbage collector's walks", freeze_heap())
        yield
        await app.state.services.close()

    app = FastAPI(title="mmrag", version="0.1.0", lifespan=lifespan, dependencies=[Depends(reject_invalid_text)],
                  description="Questions over figure-heavy documents, answered by a VLM with page citations.")
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes, allowances=body_allowances(settings))
    app.add_middleware(BodyReadTimeout, seconds=settings.http_body_timeout_s)
    errors.install(app, errors.ServerPaths.of(settings.folders))
    metrics.instrument_app(app)
    for module in (health, ask, documents, ingest, openai, ui):
        app.include_router(module.router)
    return app
