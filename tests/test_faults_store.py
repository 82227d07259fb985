"""Faults of the feature store while serving, on 127.0.0.1: Redis killed, stopped (hung) or refusing writes, and
the data dir's disk full during a feature write. Real redis-server processes and a real tmpfs, no mocks."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from mmrag.adapters.store import DiskFeatureStore, FeatureStoreError, RedisFeatureStore
from mmrag.core.pages import EncodedImage
from tests.conftest import copy_corpus, free_port, serving
from tests.test_store import key, value
from tests.waiting import eventually_sync

QUESTION = {"question": "What is the retry limit of the ingest service?"}


class RedisProcess:
    """A redis-server of the test's own (the session's `redis_url` one serves other tests), password-protected,
    every write fsynced to an append-only file in its own folder, so a restart brings back every acknowledged
    entry: that is Redis "returning" after a kill."""

    password = "s3cret-pw"

    def __init__(self, workdir: Path) -> None:
        self.exe = shutil.which("redis-server") or pytest.skip(
            "redis-server is not installed: apt-get install redis-server (make test does it as root)")
        self.workdir, self.port = workdir, free_port()
        self.url = f"redis://:{self.password}@127.0.0.1:{self.port}/0"
        self.public_url = f"redis://127.0.0.1:{self.port}/0"  # what messages may show
        self.start()

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", self.password,
             "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir),
             "--logfile", str(self.workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, password=self.password)

        def answers() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self.proc.returncode}; see {self.workdir / 'redis.log'}")
            return client.ping()  # answers LOADING (BusyLoadingError) until the append-only file is replayed

        try:
            eventually_sync(answers, timeout=60, what=f"redis-server started (see {self.workdir / 'redis.log'})",
                            ignoring=(redis.ConnectionError,))
        except BaseException:
            self.proc.kill()
            raise
        finally:
            client.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def own_redis(tmp_path) -> Iterator[RedisProcess]:
    redis_proc = RedisProcess(tmp_path)
    yield redis_proc
    redis_proc.close()


@pytest.fixture(scope="module")
async def redis_app(engine_settings, inprocess_engine, tmp_path_factory):
    """`mmrag serve`'s app whose engine reads image tokens from a Redis of the test's own, holding a copy of
    the session's entries; the session engine's disk store is put back afterwards."""
    from mmrag.wiring import create_app

    redis_proc = RedisProcess(tmp_path_factory.mktemp("store-redis"))
    disk = inprocess_engine.features.store
    try:
        store = RedisFeatureStore(redis_proc.url)
        for k in disk.keys():
            store.put(k, disk.get(k))
        data = tmp_path_factory.mktemp("store-api-data")
        copy_corpus(engine_settings, data)
        settings = engine_settings.replace(**{
            "data_dir": data, "redis_url": redis_proc.url, "answer_max_tokens": 8, "warm_top": 0})
        inprocess_engine.features.store = store
        async with serving(create_app(settings, engine=inprocess_engine, store=store)) as url:
            yield SimpleNamespace(url=url, redis=redis_proc)
    finally:
        inprocess_engine.features.store = disk
        redis_proc.close()


async def timed(request) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    response = await request
    return response, time.monotonic() - t0


def assert_store_503(response: httpx.Response, redis_proc: RedisProcess, cause: str) -> None:
    assert response.status_code == 503, response.text
    err = response.json()["error"]
    assert err["type"] == "feature_store_unavailable", err
    assert f"Redis at {redis_proc.public_url} is unreachable" in err["message"] and cause in err["message"], err
    assert "MMRAG_REDIS_URL" in err["message"] and "retry" in err["message"], err
    assert redis_proc.password not in response.text


async def test_redis_killed_while_serving_is_a_503_with_the_cause_and_the_service_recovers_without_restart(
        redis_app):
    # The client timeout is the hang detector: a request that neither answers nor fails raises ReadTimeout.
    async with httpx.AsyncClient(base_url=redis_app.url, timeout=120) as http:
        before = await http.post("/v1/ask", json=QUESTION)
        assert before.status_code == 200, before.text
        redis_app.redis.kill()
        down, down_s = await timed(http.post("/v1/ask", json=QUESTION))
        not_ready = await http.get("/readyz")
        redis_app.redis.start()  # same port, same append-only file: the entries come back
        back, back_s = await timed(http.post("/v1/ask", json=QUESTION))
        ready = await http.get("/readyz")
    print(f"\nRedis killed: 503 after {down_s:.2f} s; first ask after it returned: {back.status_code} "
          f"in {back_s:.2f} s")
    assert_store_503(down, redis_app.redis, "ConnectionError")
    assert not_ready.status_code == 503 and not_ready.json()["checks"]["redis"]["ok"] is False
    assert back.status_code == 200, back.text
    assert ready.status_code == 200 and ready.json()["checks"]["redis"]["ok"] is True, ready.text


async def test_redis_stopped_while_serving_is_a_503_after_the_socket_timeout_not_a_hang(redis_app):
    async with httpx.AsyncClient(base_url=redis_app.url, timeout=120) as http:
        assert (await http.post("/v1/ask", json=QUESTION)).status_code == 200
        redis_app.redis.signal(signal.SIGSTOP)  # alive and accepting connections, but it answers nothing
        try:
            hung, hung_s = await timed(http.post("/v1/ask", json=QUESTION))
            not_ready, not_ready_s = await timed(http.get("/readyz"))
        finally:
            redis_app.redis.signal(signal.SIGCONT)
        back = await http.post("/v1/ask", json=QUESTION)
        ready = await http.get("/readyz")
    print(f"\nRedis stopped: /v1/ask 503 after {hung_s:.2f} s, /readyz 503 after {not_ready_s:.2f} s")
    assert_store_503(hung, redis_app.redis, "TimeoutError")
    assert not_ready.status_code == 503 and "Timeout" in not_ready.json()["checks"]["redis"]["error"]
    assert back.status_code == 200, back.text
    assert ready.status_code == 200, ready.text


def big_entry(i: int) -> EncodedImage:
    return EncodedImage(torch.full((4096, 256), float(i)), torch.tensor([[1, 128, 128]]))


def assert_whole(got: EncodedImage | None, i: int) -> None:
    assert got is not None and got.image_tokens.shape == (4096, 256) and torch.all(got.image_tokens == i)


def test_no_torn_entry_is_read_after_redis_is_killed_during_writes(own_redis):
    # A writer streams 4 MB entries; Redis is SIGKILLed under it and restarted on its append-only file.
    store = RedisFeatureStore(own_redis.url)
    acknowledged: list[int] = []
    failures: list[Exception] = []

    def write() -> None:
        try:
            for i in range(10_000):
                store.put(key(i), big_entry(i))
                acknowledged.append(i)
        except Exception as exc:  # whichever it is: the test asserts it is the store's own error
            failures.append(exc)

    writer = threading.Thread(target=write)
    writer.start()

    def three_acknowledged() -> bool:
        if len(acknowledged) >= 3:
            return True
        if not writer.is_alive():
            pytest.fail(f"the writer stopped: {failures}")
        return False

    eventually_sync(three_acknowledged, timeout=120, what="three entries acknowledged")
    own_redis.kill()
    writer.join(timeout=60)
    assert isinstance(failures[0], FeatureStoreError) and "is unreachable" in str(failures[0]), failures
    attempted = len(acknowledged) + 1  # the put that was in flight when Redis died
    own_redis.start()
    reader = RedisFeatureStore(own_redis.url)
    assert set(reader.keys()) <= {key(i) for i in range(attempted)}
    for i in range(attempted):
        got = reader.get(key(i))
        if i in acknowledged or got is not None:  # acknowledged entries survive; any entry is whole
            assert_whole(got, i)


def test_a_torn_append_only_file_loses_its_last_entry_and_never_serves_half_of_it(own_redis):
    store = RedisFeatureStore(own_redis.url)
    for i in range(3):
        store.put(key(i), big_entry(i))
    own_redis.kill()
    # What a crash in the middle of Redis's own append leaves: the file ends inside the last SET.
    (aof,) = (own_redis.workdir / "appendonlydir").glob("*.incr.aof")
    os.truncate(aof, aof.stat().st_size - 1_000_000)
    own_redis.start()
    reader = RedisFeatureStore(own_redis.url)
    assert sorted(reader.keys()) == sorted([key(0), key(1)])
    assert_whole(reader.get(key(0)), 0)
    assert_whole(reader.get(key(1)), 1)
    assert reader.get(key(2)) is None
    assert "aof-load-truncated" in (own_redis.workdir / "redis.log").read_text()


def test_redis_refusing_a_write_at_maxmemory_is_a_store_error_that_says_what_it_refused(own_redis):
    store = RedisFeatureStore(own_redis.url)
    store.put(key(0), value(0))
    store.client.config_set("maxmemory", "1")  # any write now exceeds it (noeviction is the default)
    with pytest.raises(FeatureStoreError, match=r"refused the command \(SET: OutOfMemoryError: .*maxmemory"):
        store.put(key(1), value(1))
    assert torch.equal(store.get(key(0)).image_tokens, value(0).image_tokens)  # reads still serve


# --- the data dir's disk full -----------------------------------------------------------------------------


@contextlib.contextmanager
def full_tmpfs(where: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted at ``where`` for the block (fill it with :func:`fill`)."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): needs root with CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def fill(where: Path, *, room: int = 0) -> Path:
    """Fill the file system of ``where`` with ``where/filler`` until about ``room`` bytes are left."""
    filler = where / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while f.write(b"\0" * 4096):
            pass
    os.truncate(filler, max(0, filler.stat().st_size - room))
    return filler


def files_under(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_a_feature_write_on_a_full_disk_says_so_and_leaves_no_torn_file(tmp_path):
    with full_tmpfs(tmp_path / "features") as root:
        store = DiskFeatureStore(root)
        for i in range(2):
            store.put(key(i), value(i))
        filler = fill(root, room=64 * 1024)  # less room than the 512 KB entry: its write stops half-way
        before = files_under(root)
        with pytest.raises(FeatureStoreError) as raised:
            store.put(key(2), value(2, n=4096))
        after = files_under(root)
        old = [store.get(key(i)) for i in range(2)]
        missing = store.get(key(2))
        filler.unlink()  # what the message says to do: free space, then write again
        store.put(key(2), value(2, n=4096))
        recovered = store.get(key(2))
    message = str(raised.value)
    assert message.startswith(f"the disk is full at {root}:") and "Free space there" in message, message
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert after == before and not any(p.name.startswith(".tmp-") for p in after)  # no partial, no orphan temp
    assert all(torch.equal(got.image_tokens, value(i).image_tokens) for i, got in enumerate(old))
    assert missing is None
    assert torch.equal(recovered.image_tokens, value(2, n=4096).image_tokens)


@pytest.fixture(scope="module")
def full_disk_ingestor(engine_settings, sample_corpus, tmp_path_factory):
    """The ingest pipeline, as `mmrag ingest` builds it, over a data dir whose features folder is a full tmpfs."""
    from mmrag import wiring

    data = tmp_path_factory.mktemp("full-disk-data")
    with full_tmpfs(data / "features") as features:
        fill(features)
        ingestor = wiring.ingestor(engine_settings.replace(**{"data_dir": data}))
        try:
            yield SimpleNamespace(ingestor=ingestor, features=features,
                                  slide=sorted(sample_corpus.glob("*.png"))[0])
        finally:
            ingestor.index.client.close()


def test_a_page_whose_image_tokens_cannot_be_stored_writes_no_point(full_disk_ingestor):
    from ingestion.pipeline import IngestReport

    ing = full_disk_ingestor.ingestor
    with pytest.raises(FeatureStoreError, match=f"the disk is full at {full_disk_ingestor.features}"):
        ing.ingest_file(full_disk_ingestor.slide, IngestReport())
    assert ing.index.count() == 0  # no searchable page without its image tokens
    assert files_under(full_disk_ingestor.features) == [Path("filler")]  # no partial entry, no temp file


def test_ingest_on_a_full_disk_reports_the_file_as_failed_with_the_fix(full_disk_ingestor):
    ing = full_disk_ingestor.ingestor
    report = ing.run([full_disk_ingestor.slide])
    assert [Path(f.path).name for f in report.failed] == [full_disk_ingestor.slide.name]
    assert "the disk is full at" in report.failed[0].error and "Free space there" in report.failed[0].error
    assert report.pages == 0 and ing.index.count() == 0
