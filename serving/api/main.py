"""The app factory. Settings are built by the caller (CLI or tests), never at import."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import REGISTRY, CollectorRegistry

from core.settings import Settings
from serving.api import errors
from serving.api.limits import BodySizeLimit
from serving.api.routers import ask, documents, health, ingest
from serving.api.startup import build_services
from serving.metrics import Metrics


class VllmMetricsFromGlobalRegistry:
    """The in-process engine registers `vllm:*` in prometheus_client's global registry; expose them too."""

    def collect(self):
        return [m for m in REGISTRY.collect() if m.name.startswith("vllm:")]

    def describe(self):
        return []


def create_app(settings: Settings, *, engine=None) -> FastAPI:
    """``engine``: an already started engine to share (tests); otherwise the lifespan starts one."""
    # One registry per app (so an app can be built twice in one process), which also re-exports the
    # in-process vLLM engine's own `vllm:*` metrics from the global registry.
    registry = CollectorRegistry()
    registry.register(VllmMetricsFromGlobalRegistry())
    metrics = Metrics(registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.services = await build_services(settings, metrics=metrics, engine=engine)
        yield
        await app.state.services.close()

    app = FastAPI(title="mmrag", version="0.1.0", lifespan=lifespan,
                  description="Questions over figure-heavy documents, answered by a VLM with page citations.")
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    errors.install(app)
    metrics.instrument_app(app)
    for module in (health, ask, documents, ingest):
        app.include_router(module.router)
    return app
