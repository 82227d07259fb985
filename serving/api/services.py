"""What the app serves with: built once at start-up (or injected by tests), shared by every request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.settings import Settings
from ingestion.model_source import ModelSource
from ingestion.store import FeatureStore
from rag.pipeline import Pipeline
from serving.engine.base import Completion, Engine, KVCapacity, PromptPlan
from serving.ingest_jobs import IngestJobs
from serving.metrics import Metrics
from serving.warmup import WarmReport

log = logging.getLogger("mmrag.api")


class MeteredEngine:
    """The engine with every completion counted: answers, decomposition and warm-up alike."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.inner = engine
        self.metrics = metrics
        self.model_name = engine.model_name
        self.random_weights = engine.random_weights

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None) -> Completion:
        completion = await self.inner.generate(plan, on_first_token=on_first_token)
        self.metrics.record_completion(completion.usage)
        return completion

    async def kv_capacity(self) -> KVCapacity:
        return await self.inner.kv_capacity()

    async def close(self) -> None:
        await self.inner.close()

    def __getattr__(self, name: str) -> Any:  # reset_prefix_cache, renderer, ... of the wrapped engine
        return getattr(self.inner, name)


@dataclass(slots=True)
class Services:
    settings: Settings
    model: ModelSource
    engine: MeteredEngine
    pipeline: Pipeline
    store: FeatureStore
    metrics: Metrics
    jobs: IngestJobs
    warm_report: WarmReport | None = None
    owns_engine: bool = True  # tests inject the session engine and close it themselves
    _drain_task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def qdrant(self):
        return self.pipeline.searcher.client

    async def close(self) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
        self.jobs.shutdown()
        self.metrics.unregister()
        await self.qdrant.close()
        if self.owns_engine:
            await self.engine.close()

    def start_metrics_drain(self, every_s: float = 1.0) -> None:
        """Scheduler stats are drained into histograms on a timer (and at each scrape via the collector)."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(every_s)
                if self.pipeline.scheduler is not None:
                    self.metrics.drain_scheduler(self.pipeline.scheduler.stats)

        self._drain_task = asyncio.get_running_loop().create_task(loop())

