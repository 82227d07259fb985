"""What the app serves with: built once at start-up by the composition root (mmrag/wiring/), shared by
every request."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mmrag.adapters.checkpoint import ModelSource
from mmrag.adapters.qdrant import AsyncPageReader
from mmrag.adapters.store import FeatureStore
from mmrag.core.engine import Completion, Engine, EngineWrapper, OnText, PromptPlan
from mmrag.core.keys import ContentHash, ImageKey
from mmrag.core.pages import EncodedImage
from mmrag.core.settings import ApiSettings
from ingestion.loaders import decode_image, image_content_hash, image_header_size
from mmrag.core.scope import TenantScope
from rag.pipeline import Pipeline
from serving.api.admission import Admission
from serving.api.limits import RequestRates
from serving.api.renders import Renders
from serving.api.conversations import QuestionImage, TenantConversations
from serving.api.tenants import TenantKeys
from serving.ingest_jobs import TenantJobs
from serving.metrics import Metrics
from serving.pixels import TRIM_AFTER_PIXELS, PixelBudget, admit, return_freed_memory
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
    """What question images need of a vision encoder: the in-process ``mmrag.adapters.vision.VisionEncoder`` or the
    vision service's client ``mmrag.adapters.vision_client.RemoteVisionEncoder``."""

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

    Memory is bounded by configuration (issue 24, serving/pixels.py): a question is admitted by the pixels its
    images declare in their headers, before any is decoded (413 over MMRAG_MAX_REQUEST_PIXELS, 429 over what
    MMRAG_MAX_PIXELS_IN_FLIGHT has left, all questions of the process together: tenant views share this object),
    and its images are decoded one at a time, each just before its encode, its pixels given back once encoded.
    """

    def __init__(self, settings: ApiSettings, store: FeatureStore, make_encoder: Callable[[], ImageEncoder]) -> None:
        self.settings = settings
        self.store = store
        self._make_encoder = make_encoder
        self._encoder: ImageEncoder | None = None
        # One forward at a time: a second question with the same new image finds it stored, and the
        # encoder's forward counter tells each question its own forwards.
        self._lock = threading.Lock()
        self.pixels = PixelBudget(settings.max_pixels_in_flight)
        self._prepare_s = 1.0  # moving average of a question's images' time: a 429's Retry-After

    async def prepare(self, blobs: Sequence[bytes]) -> tuple[list[QuestionImage], int]:
        """The images (each distinct one once, in order) and the vision forwards they cost; off the event loop,
        decoding included (a 10 MB PNG takes a while)."""
        return await asyncio.to_thread(self._prepare, list(blobs))

    def _prepare(self, blobs: list[bytes]) -> tuple[list[QuestionImage], int]:
        documents = self.settings.documents
        sizes = [image_header_size(blob, documents) for blob in blobs]  # every image checked before any work
        started = time.monotonic()
        tokens: dict[ImageKey, int] = {}  # each distinct image once, in the order sent
        forwards = 0
        with admit(self.pixels, sizes, request_limit=self.settings.max_request_pixels,
                   retry_after_s=lambda: max(1, math.ceil(self._prepare_s))) as hold:
            for blob, (width, height) in zip(blobs, sizes, strict=True):
                key, count, spent = self._encode(decode_image(blob, documents))
                tokens.setdefault(key, count)
                forwards += spent
                hold.release(width * height)  # its pixels are garbage now: the next image may take them
        self._prepare_s += 0.2 * (time.monotonic() - started - self._prepare_s)
        if hold.pixels >= TRIM_AFTER_PIXELS:
            return_freed_memory()
        return [QuestionImage(k, n) for k, n in tokens.items()], forwards

    def _encode(self, picture: Image.Image) -> tuple[ImageKey, int, int]:
        """The picture's key, its image tokens, and the vision forwards it cost (0 when the store has it)."""
        content = image_content_hash(picture)
        with self._lock:
            if self._encoder is None:
                self._encoder = self._make_encoder()
            encoder = self._encoder
            key = encoder.key_for(content)
            if self.store.contains(key):
                return key, encoder.num_tokens_for(picture), 0
            before = encoder.forwards
            (value,) = encoder.encode([picture])
            self.store.put(key, value)
            return key, value.num_tokens, encoder.forwards - before


@dataclass(slots=True)
class Services:
    """What a request is served with: the process-wide parts (engine, scheduler, store, metrics, admission)
    and one tenant's own (``pipeline`` searching its collection with its cache salt, ``pages``, ``jobs``,
    ``conversations``). The app holds the default tenant's; the key a request brings picks its tenant's view
    from ``tenants`` (serving/api/deps.py), so a route only ever sees one tenant's documents."""

    settings: ApiSettings  # the REST service's section (Settings.api)
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
    scope: TenantScope  # the tenant's, as the wiring built it (mmrag/core/scope.py)
    tenants: dict[str, Services] = field(default_factory=dict)  # every tenant's view, by name
    rates: RequestRates = field(default_factory=lambda: RequestRates({}))  # each tenant's requests a second
    renders: Renders = field(default_factory=Renders)  # page images, fair between tenants, kept once made
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
        self.renders.close()
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
