"""What the app serves with: built once at start-up by the composition root (mmrag/wiring.py), shared by
every request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from adapters.checkpoint import ModelSource
from adapters.qdrant import AsyncPageReader
from adapters.store import FeatureStore
from core.engine import Completion, Engine, KVCapacity, PromptPlan
from core.settings import Settings
from rag.pipeline import Pipeline
from serving.api.admission import Admission
from serving.ingest_jobs import IngestJobs
from serving.metrics import Metrics
from serving.scheduler import Scheduler
from serving.warmup import WarmReport


class MeteredEngine:
    """The engine with every completion counted: answers and decomposition alike. Warm-up goes to
    ``inner``: its prefills are misses by design and would drag the hit-rate panels down."""

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

    async def reset_prefix_cache(self) -> None:
        await self.inner.reset_prefix_cache()

    async def close(self) -> None:
        await self.inner.close()


@dataclass(slots=True)
class Services:
    settings: Settings
    model: ModelSource
    engine: MeteredEngine
    pipeline: Pipeline
    scheduler: Scheduler
    store: FeatureStore
    pages: AsyncPageReader
    metrics: Metrics
    jobs: IngestJobs
    admission: Admission
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
                self.metrics.drain_scheduler(self.scheduler.stats)

        self._drain_task = asyncio.get_running_loop().create_task(loop())
