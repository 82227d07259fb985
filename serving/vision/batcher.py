"""Dynamic batching for the vision service: images of concurrent callers share one forward of the tower.

A batch leaves when it holds ``max_batch`` images or when its first image has waited ``max_wait_ms``. One
forward runs at a time, in a worker thread (the event loop keeps accepting meanwhile); images queued during
a forward leave together right after it. A key already stored is read, not encoded; a key in flight (queued,
being encoded, or being looked up) is awaited by every later caller: one forward per key, however many ask.
At most ``queue_cap`` images wait for a forward; a request that would exceed it is refused whole, with a
retry delay estimated from the queue and the last forward's time, before anything of it is queued.

The queue holds an image's loader, not its pixels: the caller decoded it once for its key and let the pixels go,
and the forward decodes it again just before encoding (a page costs a few ms of decode next to ~100 ms of
preprocessing and forward). Decoded pixels then live only while a key is computed and during a forward, whatever
the queue holds: a full queue of 7000x7000 PNGs is their compressed bytes, not 147 MB of RGB each.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from PIL import Image

from mmrag.adapters.store import FeatureStore
from mmrag.core.keys import ImageKey
from mmrag.core.pages import EncodedImage


class Source(str, enum.Enum):
    """Where an answered image's tokens came from."""

    FORWARD = "forward"  # this request's own forward
    STORE = "store"  # the feature store already held them
    SHARED = "shared"  # a forward another request (or an earlier image of this one) was already waiting for


class QueueFullError(Exception):
    """The request's new images would exceed the queue cap: the caller should retry after ``retry_after_s``."""

    def __init__(self, queued: int, cap: int, retry_after_s: int) -> None:
        super().__init__(f"{queued} images are waiting for the vision tower, the queue holds at most {cap}")
        self.retry_after_s = retry_after_s


# The image, decoded when its forward is about to run (and let go after it).
LoadImage = Callable[[], Image.Image]


class Encoder(Protocol):
    def encode(self, images: list[Image.Image]) -> list[EncodedImage]: ...


class BatchObserver(Protocol):
    """What the metrics layer is told (serving/vision/metrics.py)."""

    def batch(self, size: int, waits_s: list[float]) -> None: ...

    def answered(self, sources: list[Source]) -> None: ...


@dataclass(slots=True)
class _Waiting:
    key: ImageKey
    load: LoadImage
    future: asyncio.Future[EncodedImage]
    queued_at: float = field(default_factory=time.monotonic)


class VisionBatcher:
    def __init__(self, encoder: Encoder, store: FeatureStore, *, max_batch: int, max_wait_ms: float, queue_cap: int,
                 observe: BatchObserver) -> None:
        self.encoder = encoder
        self.store = store
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.queue_cap = queue_cap
        self.observe = observe
        self.queued = 0  # images admitted for a forward and not finished: what queue_cap bounds
        self._queue: asyncio.Queue[_Waiting] = asyncio.Queue()
        self._in_flight: dict[ImageKey, asyncio.Future[EncodedImage]] = {}
        self._last_forward_s = 0.0
        self._runner: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._runner is not None and not self._runner.done()

    def start(self) -> None:
        self._runner = asyncio.get_running_loop().create_task(self._run(), name="vision-batcher")

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    def retry_after_s(self, images: int) -> int:
        """Whole seconds until ``images`` more would likely find room: the batches ahead of them, each taking the
        last forward's time (at least the batch wait)."""
        batches_ahead = math.ceil((self.queued + images) / self.max_batch)
        return max(1, math.ceil(batches_ahead * max(self._last_forward_s, self.max_wait_s)))

    async def encode(self, items: list[tuple[ImageKey, LoadImage]], *,
                     on_answered: Callable[[int], None] = lambda index: None) -> list[tuple[EncodedImage, Source]]:
        """Tokens for each (key, image loader), in order: stored, shared with a forward in flight, or encoded.
        ``on_answered(i)`` is called as soon as item i is answered (or its forward failed), so the caller can let
        go of what it holds for that image while the others wait."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[EncodedImage]] = []
        sources: list[Source] = []
        mine: dict[ImageKey, tuple[asyncio.Future[EncodedImage], LoadImage]] = {}
        for key, load in items:
            if key in self._in_flight:
                futures.append(self._in_flight[key])
                sources.append(Source.SHARED)
                continue
            future = self._in_flight[key] = loop.create_future()
            future.add_done_callback(lambda _, k=key: self._in_flight.pop(k, None))
            mine[key] = (future, load)
            futures.append(future)
            sources.append(Source.FORWARD)
        try:
            stored = await self._admit(mine)
        except BaseException as exc:  # the lookup failed, the queue is full, or this caller left
            for future, _ in mine.values():
                if future.done():
                    continue
                if isinstance(exc, Exception):
                    future.set_exception(exc)  # every caller sharing these keys learns why
                    future.exception()  # marked retrieved: this caller raises it itself
                else:
                    future.cancel()
            raise
        sources = [Source.STORE if s is Source.FORWARD and k in stored else s
                   for (k, _), s in zip(items, sources, strict=True)]
        for index, future in enumerate(futures):
            future.add_done_callback(lambda _, i=index: on_answered(i))
        # shield: a caller that goes away must not cancel a forward other callers share
        results = await asyncio.gather(*(asyncio.shield(f) for f in futures), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        self.observe.answered(sources)
        return list(zip(results, sources, strict=True))

    async def _admit(self, mine: dict[ImageKey, tuple[asyncio.Future[EncodedImage], LoadImage]]
                     ) -> set[ImageKey]:
        """Answer the stored keys (returned) and queue the rest at once, so one caller's images leave in one
        batch, in their order."""
        if not mine:
            return set()
        found = await asyncio.to_thread(lambda: {k: self.store.get(k) for k in mine})
        missing = [k for k, value in found.items() if value is None]
        if self.queued + len(missing) > self.queue_cap:
            raise QueueFullError(self.queued, self.queue_cap, self.retry_after_s(len(missing)))
        for key, value in found.items():
            if value is not None:
                mine[key][0].set_result(value)
        self.queued += len(missing)
        for key in missing:
            self._queue.put_nowait(_Waiting(key, mine[key][1], mine[key][0]))
        return set(found) - set(missing)

    async def _run(self) -> None:
        while True:
            batch = await self._next_batch()
            started = time.monotonic()
            self.observe.batch(len(batch), [started - w.queued_at for w in batch])
            try:
                values = await asyncio.to_thread(self._forward, batch)
            except Exception as exc:  # a failed forward or store write fails its callers, never the batcher
                for waiting in batch:
                    waiting.future.set_exception(exc)
            else:
                for waiting, value in zip(batch, values, strict=True):
                    waiting.future.set_result(value)
            finally:
                self.queued -= len(batch)
                self._last_forward_s = time.monotonic() - started

    async def _next_batch(self) -> list[_Waiting]:
        batch = [await self._queue.get()]
        deadline = batch[0].queued_at + self.max_wait_s
        while len(batch) < self.max_batch:
            if self._queue.empty():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except TimeoutError:
                    break
            else:
                batch.append(self._queue.get_nowait())
        return batch

    def _forward(self, batch: list[_Waiting]) -> list[EncodedImage]:
        """In a worker thread: one forward, then each entry stored before any caller is answered (a caller
        told "encoded" may read it from the store at once). The images are decoded here, just before the forward,
        and let go with it."""
        values = self.encoder.encode([w.load() for w in batch])
        for waiting, value in zip(batch, values, strict=True):
            self.store.put(waiting.key, value)
        return values
