"""What the app serves with: built once at start-up by the composition root (mmrag/wiring.py), shared by
every request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from adapters.checkpoint import ModelSource
from adapters.qdrant import AsyncPageReader
from adapters.store import FeatureStore
from core.engine import Completion, Engine, EngineWrapper, OnText, PromptPlan
from core.keys import ContentHash, ImageKey
from core.pages import EncodedImage
from core.settings import Settings
from ingestion.loaders import decode_image, image_content_hash
from core.scope import TenantScope
from rag.pipeline import Pipeline
from serving.api.admission import Admission
from serving.api.conversations import QuestionImage, TenantConversations
from serving.api.tenants import TenantKeys
from serving.ingest_jobs import TenantJobs
from serving.metrics import Metrics
from serving.scheduler import Scheduler
from serving.warmup import WarmReport

if TYPE_CHECKING:
    from PIL import Image


class MeteredEngine(EngineWrapper):
    """The engine with every completion counted: answers and decomposition alike. Warm-up goes to
    ``inner``: its prefills are misses by design and would drag the hit-rate panels down."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        super().__init__(engine)
        self.metrics = metrics

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None,
                       on_text: OnText | None = None) -> Completion:
        completion = await self.inner.generate(plan, on_first_token=on_first_token, on_text=on_text)
        self.metrics.record_completion(completion.usage)
        return completion


class ImageEncoder(Protocol):
    """What question images need of a vision encoder: the in-process ``adapters.vision.VisionEncoder`` or the
    vision service's client ``adapters.vision_client.RemoteVisionEncoder``."""

    forwards: int

    def key_for(self, content_hash: ContentHash) -> ImageKey: ...

    def num_tokens_for(self, image: Image.Image) -> int: ...

    def encode(self, images: list[Image.Image]) -> list[EncodedImage]: ...


class QuestionImages:
    """Images sent with questions, made into image tokens the engine loads like a page's.

    Decoded with ingestion's defences and hashed as ingestion hashes a page (``ingestion.loaders``), keyed by
    the configured encoder, encoded only when the store lacks the key, and stored there. The encoder is built
    on first use (``make_encoder``: a view of the process's one tower, wiring.vision_tower, which ingestion and
    tiers share), so a server whose work never needs one loads no tower, and a vision service that is down fails
    only the questions that bring one; a later question tries to build it again.
    """

    def __init__(self, settings: Settings, store: FeatureStore, make_encoder: Callable[[], ImageEncoder]) -> None:
        self.settings = settings
        self.store = store
        self._make_encoder = make_encoder
        self._encoder: ImageEncoder | None = None
        # One forward at a time: a second question with the same new image finds it stored, and the
        # encoder's forward counter tells each question its own forwards.
        self._lock = threading.Lock()

    async def prepare(self, blobs: Sequence[bytes]) -> tuple[list[QuestionImage], int]:
        """The images (each distinct one once, in order) and the vision forwards they cost; off the event loop,
        decoding included (a 10 MB PNG takes a while)."""
        return await asyncio.to_thread(self._prepare, list(blobs))

    def _prepare(self, blobs: list[bytes]) -> tuple[list[QuestionImage], int]:
        pictures = [decode_image(blob, self.settings) for blob in blobs]
        with self._lock:
            if self._encoder is None:
                self._encoder = self._make_encoder()
            encoder = self._encoder
            by_key = dict(zip((encoder.key_for(image_content_hash(p)) for p in pictures), pictures))
            new = [k for k in by_key if not self.store.contains(k)]
            before = encoder.forwards
            encoded = dict(zip(new, encoder.encode([by_key[k] for k in new]), strict=True))
            for key, value in encoded.items():
                self.store.put(key, value)
            forwards = encoder.forwards - before
        tokens = {k: encoded[k].num_tokens if k in encoded else encoder.num_tokens_for(p) for k, p in by_key.items()}
        return [QuestionImage(k, tokens[k]) for k in by_key], forwards


@dataclass(slots=True)
class Services:
    """What a request is served with: the process-wide parts (engine, scheduler, store, metrics, admission)
    and one tenant's own (``pipeline`` searching its collection with its cache salt, ``pages``, ``jobs``,
    ``conversations``). The app holds the default tenant's; the key a request brings picks its tenant's view
    from ``tenants`` (serving/api/deps.py), so a route only ever sees one tenant's documents."""

    settings: Settings
    model: ModelSource
    engine: MeteredEngine
    pipeline: Pipeline
    scheduler: Scheduler
    store: FeatureStore
    pages: AsyncPageReader
    metrics: Metrics
    jobs: TenantJobs
    admission: Admission
    question_images: QuestionImages
    conversations: TenantConversations
    keys: TenantKeys
    scope: TenantScope  # the tenant's, as the wiring built it (core/scope.py)
    tenants: dict[str, Services] = field(default_factory=dict)  # every tenant's view, by name
    warm_report: WarmReport | None = None
    owns_engine: bool = True  # tests inject the session engine and close it themselves
    _drain_task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def tenant(self) -> str:
        return self.scope.tenant

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
