"""AnswerStore: the answer cache's bytes by (tenant, key), bounded per tenant, on local disk or in Redis.

rag/answer_cache.py decides what is cached and under which key; this module only keeps bytes. Each tenant
holds at most ``keep`` entries (the bound is the caller's, passed on every ``put``): beyond it the least
recently used go, where a ``get`` that finds an entry counts as a use. One tenant's entries never push out
another's, and a lookup names its tenant, so no tenant can read another's answers even with the same key.

Redis when MMRAG_REDIS_URL is set, like the feature store (so every replica of a deployment shares the
answers), else one folder per tenant under ``data_dir/answers``. Both are synchronous; the cache calls them
off the event loop.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from mmrag.adapters.files import write_atomically
from mmrag.adapters.store import pid_alive, redis_client
from mmrag.core.settings import check_tenant

REDIS_PREFIX = "mmrag:answers:"
_KEY = re.compile(r"[0-9a-f]{16,128}")  # answer keys are hex digests: safe as file names and Redis names
_SUFFIX = ".json"
_TMP_PREFIX = ".tmp-"


class AnswerStoreError(RuntimeError):
    """The store cannot read or keep an entry (Redis unreachable or refusing, the disk full or unwritable). The
    answer cache logs it and answers without the cache: a cache failure never fails a question."""


class AnswerStore(Protocol):
    backend: str  # "disk" | "redis"

    def get(self, tenant: str, key: str) -> bytes | None:
        """The entry's bytes, and the entry marked as just used; None when there is none."""
        ...

    def put(self, tenant: str, key: str, value: bytes, *, keep: int) -> int:
        """Store (or replace) the entry as the tenant's most recently used; then remove the tenant's least
        recently used entries beyond ``keep``. Returns how many were removed."""
        ...

    def delete(self, tenant: str, key: str) -> None:
        """Remove the entry (a corrupt one); one already gone is no error."""
        ...

    def keys(self, tenant: str) -> list[str]:
        """The tenant's keys, least recently used first."""
        ...


def check_key(key: str) -> str:
    if not _KEY.fullmatch(key):
        raise ValueError(f"answer key {key!r}: expected a lowercase hex digest (rag/answer_cache.answer_key)")
    return key


class _Clock:
    """Wall-clock time that never repeats within a process: two uses in one clock tick keep their order, so
    least-recently-used is exact for one process (file mtimes are set from it; the coarse kernel clock that
    stamps a file by itself ticks every few milliseconds)."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def ns(self) -> int:
        with self._lock:
            self._last = max(time.time_ns(), self._last + 1_000)  # 1 µs apart: distinct in a float score too
            return self._last


_CLOCK = _Clock()


class DiskAnswerStore:
    """``root/<tenant>/<key>.json``, written atomically (temp file + rename); a use is the file's mtime, set on
    every put and every get, and eviction removes the oldest mtimes. Several processes may share the folder:
    a reader sees a whole entry or none, and a race between two evictions removes a file twice, harmlessly."""

    backend = "disk"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_orphaned_temp_files()

    def _folder(self, tenant: str) -> Path:
        return self.root / check_tenant(tenant)

    def _path(self, tenant: str, key: str) -> Path:
        return self._folder(tenant) / f"{check_key(key)}{_SUFFIX}"

    def get(self, tenant: str, key: str) -> bytes | None:
        path = self._path(tenant, key)
        try:
            value = path.read_bytes()
            now = _CLOCK.ns()
            with contextlib.suppress(FileNotFoundError):  # evicted (by another process) since the read
                os.utime(path, ns=(now, now))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise AnswerStoreError(f"cannot read the answer cache entry {path}: {exc.strerror}; check that "
                                   f"{self.root} is readable and writable by this process") from exc
        return value

    def put(self, tenant: str, key: str, value: bytes, *, keep: int) -> int:
        path = self._path(tenant, key)
        try:
            write_atomically(path, value, prefix=f"{_TMP_PREFIX}{os.getpid()}-", suffix=_SUFFIX)
            now = _CLOCK.ns()
            os.utime(path, ns=(now, now))
            return self._evict(path.parent, keep)
        except OSError as exc:
            raise AnswerStoreError(
                f"cannot write the answer cache entry {path} ({len(value)} bytes): {exc.strerror}. Free space "
                f"under {self.root}, point MMRAG_DATA_DIR elsewhere, or set MMRAG_ANSWER_CACHE=false") from exc

    def _entries(self, folder: Path) -> list[tuple[int, str, Path]]:
        """(mtime, key, path) of a tenant's entries, oldest first (a key breaks an mtime tie: one order)."""
        found = []
        with contextlib.suppress(FileNotFoundError), os.scandir(folder) as it:
            for entry in it:
                if entry.name.startswith(_TMP_PREFIX) or not entry.name.endswith(_SUFFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
                    found.append((entry.stat().st_mtime_ns, entry.name[: -len(_SUFFIX)], Path(entry.path)))
        return sorted(found)

    def _evict(self, folder: Path, keep: int) -> int:
        entries = self._entries(folder)
        over = entries[: max(len(entries) - keep, 0)]
        for _, _, path in over:
            path.unlink(missing_ok=True)
        return len(over)

    def delete(self, tenant: str, key: str) -> None:
        self._path(tenant, key).unlink(missing_ok=True)

    def keys(self, tenant: str) -> list[str]:
        return [key for _, key, _ in self._entries(self._folder(tenant))]

    def _remove_orphaned_temp_files(self) -> None:
        # A writer killed between its temp file and the rename leaves the temp file; its name carries the PID,
        # so a live writer's (another process sharing the folder) is left alone.
        for tmp in self.root.glob(f"*/{_TMP_PREFIX}*"):
            pid = tmp.name[len(_TMP_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                tmp.unlink(missing_ok=True)


class RedisAnswerStore:
    """Per tenant: a sorted set ``mmrag:answers:<tenant>:lru`` of its keys scored by last use (epoch seconds),
    and each entry a string ``mmrag:answers:<tenant>:a:<key>``. A put writes the entry and its score in one
    MULTI/EXEC and, when the set is over the bound, removes the oldest entries and their scores in another:
    two puts evicting at once may remove a few more than needed, never leave an entry without its score.
    A get reads the entry and renews its score in one MULTI/EXEC (``ZADD XX``: an evicted key is not revived)."""

    backend = "redis"

    def __init__(self, url: str, *, prefix: str = REDIS_PREFIX, timeout_s: float = 2.0) -> None:
        """``timeout_s`` bounds every connect and read, so a hung Redis costs a question about that much before it
        is answered without the cache; a lost connection is retried once on a fresh one."""
        import redis

        self.client, self.where = redis_client(url, timeout_s)
        self.prefix = prefix
        self._failed = redis.RedisError

    def _lru(self, tenant: str) -> str:
        return f"{self.prefix}{check_tenant(tenant)}:lru"

    def _entry(self, tenant: str, key: str) -> str:
        return f"{self.prefix}{check_tenant(tenant)}:a:{check_key(key)}"

    def _call(self, command: str, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except self._failed as exc:
            raise AnswerStoreError(f"Redis at {self.where}: {command} failed ({type(exc).__name__}: {exc}); start "
                                   "it or fix MMRAG_REDIS_URL, or set MMRAG_ANSWER_CACHE=false") from exc

    def get(self, tenant: str, key: str) -> bytes | None:
        lru, name = self._lru(tenant), self._entry(tenant, key)
        value, _ = self._call("GET", lambda: self.client.pipeline(transaction=True).get(name)
                              .zadd(lru, {key: _CLOCK.ns() / 1e9}, xx=True).execute())
        return value

    def put(self, tenant: str, key: str, value: bytes, *, keep: int) -> int:
        lru, name = self._lru(tenant), self._entry(tenant, key)
        _, _, count = self._call("SET", lambda: self.client.pipeline(transaction=True).set(name, value)
                                 .zadd(lru, {key: _CLOCK.ns() / 1e9}).zcard(lru).execute())
        if count <= keep:
            return 0
        oldest = [k.decode() for k in self._call("ZRANGE", lambda: self.client.zrange(lru, 0, count - keep - 1))]
        if oldest:
            pipe = self.client.pipeline(transaction=True).zrem(lru, *oldest)
            self._call("UNLINK", pipe.unlink(*(self._entry(tenant, k) for k in oldest)).execute)
        return len(oldest)

    def delete(self, tenant: str, key: str) -> None:
        lru, name = self._lru(tenant), self._entry(tenant, key)
        self._call("UNLINK", self.client.pipeline(transaction=True).unlink(name).zrem(lru, key).execute)

    def keys(self, tenant: str) -> list[str]:
        return [k.decode() for k in self._call("ZRANGE", lambda: self.client.zrange(self._lru(tenant), 0, -1))]


def open_answer_store(*, redis_url: str, folder: Path) -> AnswerStore:
    """Redis at ``redis_url`` when set (the wiring passes MMRAG_REDIS_URL: the feature store's Redis, under its own
    prefix), else local disk under ``folder`` (``data_dir/answers``): the feature store's rule."""
    return RedisAnswerStore(redis_url) if redis_url else DiskAnswerStore(folder)
