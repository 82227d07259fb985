"""FeatureStore: image tokens by ImageKey, on local disk (default) or in Redis.

Entries are content-addressed and immutable: a key names exactly one (tokens, grid) pair, so an entry is
written once and never updated. Each blob records its own key, and a read checks it, so no key can ever
serve another image's tokens (a renamed or swapped file is refused, not served).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol
from urllib.parse import urlsplit

import safetensors.torch
import torch
from safetensors import SafetensorError

from mmrag.adapters.files import write_atomically
from mmrag.core.keys import ImageKey, ResolutionPolicy
from mmrag.core.pages import EncodedImage
from mmrag.core.payload import STALE_PAGES_FIX, EncoderScope

log = logging.getLogger(__name__)

_KEY_META = "mmrag_image_key"
_SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
_LEASES = ".leases"


class FeatureStoreError(RuntimeError):
    """The store cannot serve or keep an entry: unreadable, under the wrong key, its backend unreachable or its
    disk full. The API maps it to 503; the message names the store and the fix."""


@dataclass(slots=True)
class StoreStats:
    """Counts since the store was opened; exported to Prometheus by serving/metrics."""

    lookups: int = 0
    hits: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def record_lookup(self, hit: bool, nbytes: int = 0) -> None:
        self.lookups += 1
        if hit:
            self.hits += 1
            self.bytes_read += nbytes


def encode_entry(key: ImageKey, value: EncodedImage) -> bytes:
    tensors = {"image_tokens": value.image_tokens.contiguous(), "grid_thw": value.grid_thw.contiguous()}
    if value.pixels_png is not None:  # the pixels form's image (MMRAG_IMAGE_INPUT=pixels), beside the tokens
        tensors[PIXELS_TENSOR] = torch.frombuffer(bytearray(value.pixels_png), dtype=torch.uint8)
    return safetensors.torch.save(tensors, metadata={_KEY_META: str(key)})


def decode_entry(key: ImageKey, blob: bytes) -> EncodedImage:
    try:
        tensors = safetensors.torch.load(blob)
        meta = _read_metadata(blob)
    except (SafetensorError, ValueError) as exc:
        raise FeatureStoreError(f"feature entry for {key} is unreadable ({exc}); delete it and re-ingest") from exc
    if meta.get(_KEY_META) != str(key):
        raise FeatureStoreError(
            f"feature entry under {key} belongs to {meta.get(_KEY_META)!r}; refusing to serve it. "
            "Delete the entry and re-ingest the page."
        )
    png = tensors.get(PIXELS_TENSOR)
    return EncodedImage(image_tokens=tensors["image_tokens"], grid_thw=tensors["grid_thw"],
                        pixels_png=png.numpy().tobytes() if png is not None else None)


def _read_metadata(blob: bytes) -> dict[str, str]:
    # safetensors.torch.load drops the header metadata; read it from the header itself
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    return header.get("__metadata__", {})


def _header_has_pixels(key: ImageKey, header: bytes) -> bool:
    """Whether a safetensors header (its JSON, without the length prefix) lists the entry's pixels."""
    try:
        return PIXELS_TENSOR in json.loads(header)
    except ValueError as exc:
        raise FeatureStoreError(f"feature entry for {key} is unreadable ({exc}); delete it and re-ingest") from exc


PIXELS_TENSOR = "pixels_png"


class FeatureStore(Protocol):
    backend: str
    stats: StoreStats

    def get(self, key: ImageKey) -> EncodedImage | None: ...

    def put(self, key: ImageKey, value: EncodedImage) -> None: ...

    def contains(self, key: ImageKey) -> bool: ...

    def has_pixels(self, key: ImageKey) -> bool | None:
        """Whether the entry keeps its image's pixels (MMRAG_IMAGE_INPUT=pixels) beside its tokens; None when there
        is no entry. Reads the entry's header only, not its tokens."""
        ...

    def keys(self) -> Iterator[ImageKey]: ...

    def size(self, key: ImageKey) -> int | None:
        """The entry's size in bytes; None when there is none."""
        ...

    def delete(self, key: ImageKey) -> int:
        """Remove the entry at once (a reader sees all of it or nothing); the bytes freed, 0 if it was gone or is
        leased (kept until its last lease ends or expires)."""
        ...

    def lease(self, keys: Iterable[ImageKey], holder: str, ttl_s: float) -> None:
        """Take or renew ``holder``'s lease on ``keys`` for ``ttl_s`` seconds: while one lease on a key is live,
        ``delete`` keeps its entry (a document's deletion, ``mmrag store gc``), in any process sharing the store.
        A lease outlives a killed holder by at most ``ttl_s``. Leasing a key that is not stored is allowed (an
        ingest leases what it is about to write); a holder checks ``contains`` after leasing to know."""
        ...

    def release(self, keys: Iterable[ImageKey], holder: str) -> None:
        """End ``holder``'s leases on ``keys`` (one it does not hold is ignored)."""
        ...

    def leased(self, key: ImageKey) -> bool:
        """Whether any holder's lease on ``key`` is live."""
        ...


class StaleFeaturesError(FeatureStoreError):
    """Tokens of another vision encoder than the configured one were asked for (a page ingested before an
    upgrade): refused, since feeding them degrades answers without any error."""


class OutOfScopeWriteError(ValueError):
    """Tokens offered under a key of another encoder than the store's scope: a key that does not name the encoder
    that made its tokens would let two encoders' tokens share one key (the first writer wins). A bug of the
    caller, so it is not a FeatureStoreError (which fails one file or request and is retried)."""


class ScopedFeatureStore:
    """A store that reads and writes only the keys of one encoder: its version under its policy, or under one of
    ``tiers`` (the same tower under another resolution policy). The engines read through it (mmrag/wiring/),
    so whatever names a page — retrieval, ``--pages``, warm-up — tokens of another encoder never reach a prompt;
    writers store through it, so no tokens are filed under a key their encoder did not mint."""

    def __init__(self, store: FeatureStore, scope: EncoderScope, *, tiers: Iterable[ResolutionPolicy] = ()) -> None:
        self.inner = store
        self.scope = scope
        self.policies = frozenset({scope.policy, *tiers})
        self.backend = store.backend
        self.stats = store.stats

    def covers(self, key: ImageKey) -> bool:
        return key.encoder_version == self.scope.version and key.policy in self.policies

    def get(self, key: ImageKey) -> EncodedImage | None:
        if not self.covers(key):
            raise StaleFeaturesError(
                f"the image tokens {key} were made by another vision encoder than the configured one "
                f"({self._described()}); refusing to feed them: {STALE_PAGES_FIX}"
            )
        return self.inner.get(key)

    def put(self, key: ImageKey, value: EncodedImage) -> None:
        if not self.covers(key):
            raise OutOfScopeWriteError(
                f"refusing to store image tokens under {key}: this store holds the tokens of encoder "
                f"{self._described()} only. Key tokens with the encoder that made them (`encoder.key_for("
                f"content_hash)`, or that encoder's `with_policy(policy)` for a tier); `ImageKey.in_policy` is for "
                "looking stored tokens up, never for a key to write under"
            )
        self.inner.put(key, value)

    def contains(self, key: ImageKey) -> bool:
        return self.covers(key) and self.inner.contains(key)

    def has_pixels(self, key: ImageKey) -> bool | None:
        return self.inner.has_pixels(key) if self.covers(key) else None

    def keys(self) -> Iterator[ImageKey]:
        return (k for k in self.inner.keys() if self.covers(k))

    def size(self, key: ImageKey) -> int | None:
        return self.inner.size(key)

    def delete(self, key: ImageKey) -> int:
        return self.inner.delete(key)

    def lease(self, keys: Iterable[ImageKey], holder: str, ttl_s: float) -> None:
        self.inner.lease(keys, holder, ttl_s)

    def release(self, keys: Iterable[ImageKey], holder: str) -> None:
        self.inner.release(keys, holder)

    def leased(self, key: ImageKey) -> bool:
        return self.inner.leased(key)

    def _described(self) -> str:
        others = sorted(str(p) for p in self.policies - {self.scope.policy})
        return str(self.scope) + (f" and its tiers {', '.join(others)}" if others else "")


class _BlobStore:
    """Shared get/contains/put over a backend's raw blob I/O; every call is counted in ``stats``."""

    stats: StoreStats

    def get(self, key: ImageKey) -> EncodedImage | None:
        blob = self._read(key)
        if blob is None:
            self.stats.record_lookup(hit=False)
            return None
        value = decode_entry(key, blob)
        self.stats.record_lookup(hit=True, nbytes=len(blob))
        return value

    def contains(self, key: ImageKey) -> bool:
        hit = self._exists(key)
        self.stats.record_lookup(hit=hit)
        return hit

    def put(self, key: ImageKey, value: EncodedImage) -> None:
        blob = encode_entry(key, value)
        self._write(key, blob)
        self.stats.writes += 1
        self.stats.bytes_written += len(blob)

    def has_pixels(self, key: ImageKey) -> bool | None:
        header = self._read_header(key)
        return None if header is None else _header_has_pixels(key, header)

    def _read(self, key: ImageKey) -> bytes | None:
        raise NotImplementedError

    def _read_header(self, key: ImageKey) -> bytes | None:
        """The entry's safetensors header (its JSON), without reading the tensors; None when there is none."""
        raise NotImplementedError

    def _exists(self, key: ImageKey) -> bool:
        raise NotImplementedError

    def _write(self, key: ImageKey, blob: bytes) -> None:
        raise NotImplementedError


class DiskFeatureStore(_BlobStore):
    """One safetensors file per key under ``root/<first two hex chars>/``; atomic writes (temp + rename)."""

    backend = "disk"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.stats = StoreStats()
        self._remove_orphaned_temp_files()

    def _remove_orphaned_temp_files(self) -> None:
        # A writer killed between mkstemp and rename leaves its temp file behind. Temp names carry the
        # writer's PID, so files of a live writer (a concurrent ingest) are left alone.
        for tmp in self.root.glob(f"??/{_TMP_PREFIX}*"):
            pid = int(tmp.name[len(_TMP_PREFIX):].split("-", 1)[0])
            if not pid_alive(pid):
                tmp.unlink(missing_ok=True)

    def path_for(self, key: ImageKey) -> Path:
        return self.root / key.content_hash[:2] / f"{key}{_SUFFIX}"

    def _read(self, key: ImageKey) -> bytes | None:
        try:
            return self.path_for(key).read_bytes()
        except FileNotFoundError:
            return None

    def _exists(self, key: ImageKey) -> bool:
        return self.path_for(key).is_file()

    def _read_header(self, key: ImageKey) -> bytes | None:
        try:
            with self.path_for(key).open("rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                return f.read(n)
        except FileNotFoundError:
            return None
        except struct.error as exc:
            raise FeatureStoreError(f"feature entry for {key} is unreadable ({exc}); delete it and re-ingest") from exc

    def _write(self, key: ImageKey, blob: bytes) -> None:
        try:
            _write_atomically(self.path_for(key), blob)
        except OSError as exc:
            raise self._write_failed(key, len(blob), exc) from exc

    def _write_failed(self, key: ImageKey, nbytes: int, exc: OSError) -> FeatureStoreError:
        what = f"writing the feature entry for {key} ({nbytes / 1e6:.1f} MB) failed: {exc.strerror}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return FeatureStoreError(
                f"the disk is full at {self.root}: {what}. Free space there (or raise the volume's size or "
                "quota), or point MMRAG_DATA_DIR at a larger disk, then ingest again; stored entries still serve"
            )
        return FeatureStoreError(f"cannot write to the feature store at {self.root}: {what}; check that the "
                                 "folder exists and is writable by this process")

    def size(self, key: ImageKey) -> int | None:
        try:
            return self.path_for(key).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, key: ImageKey) -> int:
        # unlink is atomic; a reader that opened the file first still reads it whole. A lease taken between the
        # check and the unlink is not seen: its holder finds the entry gone when it checks after leasing.
        if self.leased(key):
            return 0
        path = self.path_for(key)
        try:
            nbytes = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        return nbytes

    # Leases: one empty file per holder under ``root/.leases/<key>/``, its mtime the lease's end (wall clock, so
    # every process on the host reads it alike). An expired file is removed by whoever next looks.

    def _lease_dir(self, key: ImageKey) -> Path:
        return self.root / _LEASES / str(key)

    def lease(self, keys: Iterable[ImageKey], holder: str, ttl_s: float) -> None:
        until = time.time() + ttl_s
        for key in keys:
            path = self._lease_dir(key) / _holder_name(holder)
            try:
                _stamp_lease(path, until)
            except OSError as exc:
                raise self._write_failed(key, 0, exc) from exc

    def release(self, keys: Iterable[ImageKey], holder: str) -> None:
        for key in keys:
            folder = self._lease_dir(key)
            (folder / _holder_name(holder)).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()  # the last lease on it

    def leased(self, key: ImageKey) -> bool:
        now, live = time.time(), False
        try:
            held = list(os.scandir(self._lease_dir(key)))
        except FileNotFoundError:
            return False
        for entry in held:
            try:
                if entry.stat().st_mtime > now:
                    live = True
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass  # released meanwhile
        return live

    def keys(self) -> Iterator[ImageKey]:
        for path in sorted(self.root.glob(f"??/img1-*{_SUFFIX}")):
            yield ImageKey.parse(path.name[: -len(_SUFFIX)])


class RedisFeatureStore(_BlobStore):
    """Entries as Redis strings under ``<prefix><key>``; a SET is atomic, so no torn entries either."""

    backend = "redis"

    def __init__(self, url: str, *, prefix: str = "mmrag:feat:", timeout_s: float = 2.0) -> None:
        """``timeout_s`` bounds every connect and every socket read, so a hung (e.g. SIGSTOPped) Redis fails
        a request in about that time instead of holding it forever; a lost connection is retried once on a
        fresh one, so the first request after Redis comes back succeeds, while a hang is not retried."""
        import redis

        self.client, self.where = redis_client(url, timeout_s)
        self.prefix = prefix
        self.stats = StoreStats()
        self._unreachable = (redis.ConnectionError, redis.TimeoutError)
        self._failed = redis.RedisError
        self._call("PING", self.client.ping)

    def _name(self, key: ImageKey) -> str:
        return f"{self.prefix}{key}"

    def _call(self, command: str, run: Callable[[], Any]) -> Any:
        """One Redis command; any Redis failure becomes a FeatureStoreError (503: it fails this request, not
        the server) naming Redis without its password; the next call connects afresh."""
        try:
            return run()
        except self._failed as exc:
            log.warning("Redis at %s: %s failed (%s: %s)", self.where, command, type(exc).__name__, exc)
            cause = f"{command}: {type(exc).__name__}: {exc}"
            if isinstance(exc, self._unreachable):
                raise FeatureStoreError(
                    f"Redis at {self.where} is unreachable ({cause}). Start it or fix MMRAG_REDIS_URL (unset it to "
                    "use the disk store); a running service reconnects by itself once Redis answers, so retry then"
                ) from exc
            # Redis answered but refused: OOM at maxmemory, MISCONF when its own disk is full, ...
            raise FeatureStoreError(
                f"Redis at {self.where} refused the command ({cause}); fix what it says (its log has more), "
                "e.g. raise maxmemory or free its disk"
            ) from exc

    def _read(self, key: ImageKey) -> bytes | None:
        return self._call("GET", lambda: self.client.get(self._name(key)))

    def _exists(self, key: ImageKey) -> bool:
        return bool(self._call("EXISTS", lambda: self.client.exists(self._name(key))))

    def _read_header(self, key: ImageKey) -> bytes | None:
        name = self._name(key)
        head = self._call("GETRANGE", lambda: self.client.getrange(name, 0, 7))
        if not head:
            return None
        if len(head) < 8:
            raise FeatureStoreError(f"feature entry for {key} is unreadable (truncated); delete it and re-ingest")
        (n,) = struct.unpack("<Q", head)
        return self._call("GETRANGE", lambda: self.client.getrange(name, 8, 8 + n - 1))

    def _write(self, key: ImageKey, blob: bytes) -> None:
        self._call("SET", lambda: self.client.set(self._name(key), blob))

    def size(self, key: ImageKey) -> int | None:
        nbytes = self._call("STRLEN", lambda: self.client.strlen(self._name(key)))
        return nbytes or None  # no entry is ever empty: 0 means none

    def delete(self, key: ImageKey) -> int:
        # STRLEN + UNLINK in one MULTI/EXEC: atomic, and the entry's bytes never travel. A lease taken between
        # the check and the delete is not seen: its holder finds the entry gone when it checks after leasing.
        if self.leased(key):
            return 0
        name = self._name(key)
        nbytes, _ = self._call("UNLINK", lambda: self.client.pipeline(transaction=True).strlen(name).unlink(name)
                               .execute())
        return nbytes

    # Leases: a sorted set ``<prefix>lease:<key>`` of holders scored by their lease's end (Redis's clock, from
    # TIME, so hosts with skewed clocks agree); the set itself expires with its longest lease.

    def _lease_name(self, key: ImageKey) -> str:
        return f"{self.prefix}lease:{key}"

    def _now(self) -> float:
        seconds, micros = self._call("TIME", self.client.time)
        return seconds + micros / 1e6

    def lease(self, keys: Iterable[ImageKey], holder: str, ttl_s: float) -> None:
        keys = list(keys)
        if not keys:
            return
        until, pipe = self._now() + ttl_s, self.client.pipeline(transaction=False)
        for key in keys:
            name = self._lease_name(key)
            pipe.zadd(name, {holder: until}).expire(name, max(1, math.ceil(ttl_s)), gt=True)
            pipe.expire(name, max(1, math.ceil(ttl_s)), nx=True)
        self._call("ZADD", pipe.execute)

    def release(self, keys: Iterable[ImageKey], holder: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zrem(self._lease_name(key), holder)
        self._call("ZREM", pipe.execute)

    def leased(self, key: ImageKey) -> bool:
        name, now = self._lease_name(key), self._now()
        _, live = self._call("ZCOUNT", lambda: self.client.pipeline(transaction=True)
                             .zremrangebyscore(name, "-inf", now).zcard(name).execute())
        return live > 0

    def keys(self) -> Iterator[ImageKey]:
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "img1-*"  # the prefix is literal, not a glob
        found = self._call("SCAN", lambda: list(self.client.scan_iter(match=pattern, count=1000)))
        names = sorted(n.decode() for n in found)
        for name in names:
            yield ImageKey.parse(name[len(self.prefix) :])


class StoreLease:
    """A :class:`mmrag.core.keys.KeyLease` on ``store``: one holder (``purpose``-host-pid-random), leases of ``ttl_s``
    (renewed by taking the keys again), released by ``end``."""

    def __init__(self, store: FeatureStore, purpose: str, ttl_s: float) -> None:
        self.store = store
        self.holder = new_holder(purpose)
        self.ttl_s = ttl_s
        self.held: set[ImageKey] = set()

    def take(self, keys: Iterable[ImageKey]) -> set[ImageKey]:
        keys = set(keys)
        self.store.lease(keys, self.holder, self.ttl_s)
        self.held |= keys
        # Checked after leasing, so no deletion can come between; by size, which the lookup stats do not count.
        return {k for k in keys if self.store.size(k) is None}

    def end(self) -> None:
        held, self.held = self.held, set()
        self.store.release(held, self.holder)


def _write_atomically(path: Path, blob: bytes) -> None:
    """A reader (or a run killed half-way) sees either no entry or the whole entry, never a torn file; a failed
    write (the disk full half-way) removes its temp file, whose name carries our PID for the orphan sweep."""
    write_atomically(path, blob, prefix=f"{_TMP_PREFIX}{os.getpid()}-", suffix=_SUFFIX)


LEASE_ATTEMPTS = 16


def _stamp_lease(path: Path, until: float) -> None:
    """``path`` (a holder's lease file, its folder made if missing) with ``until`` as its mtime: the lease's end.

    Another holder's release removes the key's lease folder when it held the last lease there, at any moment:
    between our mkdir and our touch (FileNotFoundError), or inside mkdir, after it found the folder there and
    before it checked that it is one (FileExistsError, pathlib's exist_ok re-raising for a folder gone). Either
    way the folder is made again: each attempt loses only to a release that ran during it."""
    for attempt in range(LEASE_ATTEMPTS):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            os.utime(path, (until, until))
            return
        except (FileNotFoundError, FileExistsError):
            if attempt == LEASE_ATTEMPTS - 1 or path.parent.exists() and not path.parent.is_dir():
                raise


def _holder_name(holder: str) -> str:
    """A holder's name as a file name: what is not a letter, digit or ``.-_`` becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", holder)[:200] or "_"


def new_holder(purpose: str) -> str:
    """A lease holder's name unique to this process and call: ``<purpose>-<host>-<pid>-<random>``."""
    return f"{purpose}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def redis_client(url: str, timeout_s: float) -> tuple[Any, str]:
    """A Redis client for ``url`` whose every connect and read is bounded by ``timeout_s`` and whose lost
    connection is retried once on a fresh one, and where it points without its password (for logs)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)))
    return client, _without_password(url)


def _without_password(url: str) -> str:
    """``redis://:secret@host:6379/0`` → ``redis://host:6379/0``: what a log line may show."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    return parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")).geturl()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` is alive (a temporary file's or a lease's writer, on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
