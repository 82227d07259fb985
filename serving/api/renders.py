"""Page-image renders (GET /v1/pages/{id}/image) shared fairly between tenants, and kept once made.

A render is seconds of CPU for a heavy PDF page and milliseconds for a figure's crop. They run on a pool of
their own (not the event loop's default executor, which every other blocking call shares), at most
``per_tenant`` of one tenant's at a time: a tenant asking for many slow renders waits behind its own, while
another tenant's render takes a free worker at once (the pool has more workers than one tenant may hold). A
made PNG is kept, up to ``max_bytes`` in all, least recently used out first, keyed by the tenant, the source
file (its path, size and modification time: a re-ingested or changed file is another key), the page and the
box, so the `/ui` page, which loads an image for every cited page, renders each once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Workers for renders, and how many one tenant may hold: a second tenant always finds one free.
RENDER_WORKERS = 4
PER_TENANT = 2
CACHE_BYTES = 64 << 20


class Renders:
    def __init__(self, *, workers: int = RENDER_WORKERS, per_tenant: int = PER_TENANT,
                 max_bytes: int = CACHE_BYTES) -> None:
        if not 1 <= per_tenant <= workers:
            raise ValueError(f"renders: 1 <= per_tenant <= workers (got {per_tenant}, {workers})")
        self.workers, self.per_tenant, self.max_bytes = workers, per_tenant, max_bytes
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mmrag-render")
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._cache: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def key(tenant: str, path: Path, *parts: Hashable) -> Hashable | None:
        """The cache key of a render of ``path`` (None when the file is gone: the render itself says so)."""
        try:
            stat = path.stat()
        except OSError:
            return None
        return (tenant, str(path), stat.st_size, stat.st_mtime_ns, *parts)

    async def png(self, tenant: str, key: Hashable | None, render: Callable[[], bytes]) -> bytes:
        """The cached PNG under ``key``, or ``render()`` on the pool within the tenant's slots, then kept."""
        if key is not None and (png := self._get(key)) is not None:
            return png
        slots = self._slots.setdefault(tenant, asyncio.Semaphore(self.per_tenant))
        async with slots:
            if key is not None and (png := self._get(key)) is not None:  # made while this one waited
                return png
            self.misses += 1
            png = await asyncio.get_running_loop().run_in_executor(self._pool, render)
        if key is not None:
            self._put(key, png)
        return png

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _get(self, key: Hashable) -> bytes | None:
        with self._lock:
            png = self._cache.get(key)
            if png is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            return png

    def _put(self, key: Hashable, png: bytes) -> None:
        if len(png) > self.max_bytes:
            return
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = png
            self._bytes += len(png)
            while self._bytes > self.max_bytes:
                _, old = self._cache.popitem(last=False)
                self._bytes -= len(old)
