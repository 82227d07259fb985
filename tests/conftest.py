"""Session fixtures: real services on 127.0.0.1 and models built offline, once per test session."""

from __future__ import annotations

import contextlib
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # any accidental hub lookup must fail fast
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The development profile, said here for every test and the processes they start: where a test leaves
# MMRAG_MODEL empty, the tiny random-weight model is built (production refuses that: tests/test_profiles.py).
os.environ["MMRAG_PROFILE"] = "development"
# The standard tier's bound for the session (and the processes it starts): half the default's pixels, so half the
# vision tower's patches and the engines' image tokens per page (~2 % of the suite's CPU, measured back to back on
# one host). A test about the default bound itself removes it (monkeypatch.delenv); one about a page's token count
# derives it.
TEST_MAX_PIXELS = 448 * 224
os.environ["MMRAG_MAX_PIXELS"] = str(TEST_MAX_PIXELS)
# On pytest-xdist workers (`make test`), the vLLM engines each worker starts, in it or in the processes it starts,
# bind their OpenMP threads to a core of that worker's own. vLLM's own binding (`auto`) assumes one engine per host
# and binds every engine to the same core (on 2 cores: core 0, core 1 left to the frontend), so the two workers'
# engines took turns on one core while the other did little more than imports.
# And torch runs one OpenMP thread in the test process and its children (the vision encoder, ingestion): with two
# threads in a process that shares the cores with an engine (or another worker), libgomp's spinning barriers burned
# the CPU the other needed — two processes of small matmuls at 2 threads each took 4.3x as long as at 1 thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER.startswith("gw") and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
    _CPUS = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_CPUS[int(_XDIST_WORKER[2:]) % len(_CPUS)])
from mmrag.adapters.hardware import reproducible_numerics  # noqa: E402 - before any matmul, as the CLI's entry does

reproducible_numerics()

import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from mmrag.devkit.ports import free_port
from serving.readiness import ServerStartError, wait_until_ready
from tests.waiting import eventually

# The lanes (make check / make test): their option, markers and guard are tests/lanes.py's hooks.
from tests.lanes import (  # noqa: F401 - pytest's hooks, found by name in this module
    pytest_addoption, pytest_collection_modifyitems, pytest_configure, pytest_runtest_makereport,
    pytest_sessionfinish, pytest_xdist_make_scheduler)
# The garbage collector's pauses: the import-time heap frozen after collection, the session's pauses printed.
from tests.gcpauses import pytest_collection_finish, pytest_terminal_summary  # noqa: F401, E402 - hooks


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server process for the session (Debian package; `make test` installs it as root)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed: apt-get install redis-server (make test does it as root)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)

    def answers_ping() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_until_ready(answers_ping, timeout_s=10, what="redis-server", proc=proc, interval_s=0.05)
    except ServerStartError:
        proc.kill()
        raise
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Qwen2-VL, built offline once per session."""
    from mmrag.devkit.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def sample_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmrag.devkit.corpus import build_sample_corpus

    out = tmp_path_factory.mktemp("corpus")
    build_sample_corpus(out)
    return out


@pytest.fixture(scope="session")
def reference_store(tmp_path_factory: pytest.TempPathFactory, sample_corpus: Path, tiny_model: Path):
    """The snapshot (feature entries, points) of one uninterrupted CLI ingest of the sample corpus, vision batch
    size 1 (batching may round differently): what every interrupted-then-resumed ingest must end as. Made once
    for the three tests that kill an ingest (CLI, `mmrag serve`, a job) and compare."""
    from tests.test_ingest import cli_env, run_cli, snapshot

    data = tmp_path_factory.mktemp("reference-ingest")
    assert run_cli("ingest", str(sample_corpus), env=cli_env(data, tiny_model, MMRAG_VISION_BATCH_SIZE="1")
                   ).returncode == 0
    return snapshot(data)


# --- the engine: one vLLM per test session --------------------------------------------------------------

ENGINE_ENV = dict(
    MMRAG_KV_BLOCK_SIZE="32",  # CPU attention wants multiples of 32; small blocks let more of a prefix hit
    MMRAG_KV_CACHE_GIB="1",
    MMRAG_ENFORCE_EAGER="true",  # ~20 s start-up instead of 25-50 s of torch.compile
    MMRAG_ENGINE_DTYPE="float32",  # exactness is compared in fp32
    MMRAG_MAX_MODEL_LEN="4096",  # one prompt over a two-part question's six pages fits, with its answer
    MMRAG_OCR="false",
    # Tests measure the engine and compare cold answers with cached ones: a repeated question must reach it.
    # The answer cache's own tests turn it on (tests/test_answer_cache.py, tests/test_answer_cache_serving.py).
    MMRAG_ANSWER_CACHE="false",
    # The scheduler tests through the app (cancellation, admission) fill its slots with a few questions' plans.
    MMRAG_MAX_CONCURRENCY="4",
)


@pytest.fixture(scope="session")
def engine_settings(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    """Settings for a session data dir holding the tiny model; engine-facing values as in ENGINE_ENV."""
    from mmrag.core.settings import Settings

    data_dir = tmp_path_factory.mktemp("engine-data")
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    return Settings(model=str(tiny_model), data_dir=data_dir)


@pytest.fixture(scope="session")
def ingested(engine_settings, sample_corpus):
    """The sample corpus ingested once into the session data dir: the store and index the engines read."""
    from mmrag import wiring

    ingestor = wiring.ingestor(engine_settings)
    report = ingestor.run([sample_corpus])
    assert not report.failed, report.failed
    ingestor.index.client.close()
    return report


@pytest.fixture(scope="session")
async def inprocess_engine(engine_settings, ingested):
    from mmrag import wiring
    from serving.engine.features import FeatureProvider
    from serving.engine.inprocess import InProcessEngine

    engine = InProcessEngine.start(
        wiring.resolve_model(engine_settings),
        FeatureProvider.unscoped(wiring.feature_store(engine_settings)),
        wiring.engine_config(engine_settings),
    )
    yield engine
    await engine.close()


# --- vllm_server: one `vllm serve` replica per session (tests/test_remote_engine.py) ---------------------


KV_EVENTS: dict[str, str] = {}  # a replica URL the tests started -> where it publishes its KV events


@pytest.fixture(scope="session")
def vllm_server(engine_settings, ingested, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of one `vllm serve` replica of the tiny model, with the engine settings of ENGINE_ENV; it publishes
    its KV events (``KV_EVENTS[url]``, tests/test_kv_events_replicas.py)."""
    import dataclasses

    from mmrag import wiring
    from serving.kv_events import free_port_pair
    from serving.vllm_launch import start_dev_replica

    # Dev mode adds POST /reset_prefix_cache, which warm-up tests use to start from a cold cache.
    events = f"tcp://*:{free_port_pair()}"
    handle = start_dev_replica(
        wiring.resolve_model(engine_settings).path,
        dataclasses.replace(wiring.engine_config(engine_settings), kv_events=events),
        tmp_path_factory.mktemp("vllm-serve") / "server.log",
        port=free_port(),
    )
    KV_EVENTS[handle.url] = events
    try:
        yield handle.url  # ready: start_dev_replica waited for it
    finally:
        handle.stop()


# --- end vllm_server -------------------------------------------------------------------------------------


# --- the REST app on a real port, in the session loop (it shares the session's in-process engine) ----------

API_KEY = "test-key"


def copy_corpus(settings, data_dir: Path) -> None:
    """The session corpus (index + features) copied to ``data_dir`` (:func:`copy_index_and_store`)."""
    copy_index_and_store(settings.storage.data_dir, data_dir)


def copy_index_and_store(source: Path, data_dir: Path) -> None:
    """A data folder's index and features copied to ``data_dir``: Qdrant local mode allows one client per folder,
    and others read the original. Not the store's leases: they are the original's holders' (a live conversation
    of a server), and nothing holds the copy."""
    shutil.copytree(source / "qdrant", data_dir / "qdrant")
    shutil.copytree(source / "features", data_dir / "features", ignore=shutil.ignore_patterns(".leases"))


@contextlib.asynccontextmanager
async def serving(app, **config) -> AsyncIterator[str]:
    """``app`` under uvicorn on a free 127.0.0.1 port, in the running (session) loop; yields its base URL.
    ``config``: more of uvicorn.Config's arguments (its ``http`` protocol class, say)."""
    import asyncio

    import uvicorn

    port = free_port()
    # The server shares the loop with every test, and a synchronous test holds that loop for as long as it runs.
    # uvicorn's keep-alive timer (5 s) on a client's idle connection then fires the moment the loop resumes: after
    # the client has just sent its next request on that connection, which is dropped (httpx.ReadError). An
    # in-test server keeps idle connections for the session; a real one runs its own loop and keeps the default.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           **{"timeout_keep_alive": 3600, **config}))
    task = asyncio.get_running_loop().create_task(server.serve())

    def started() -> bool:
        if task.done():  # it will never start: fail with why
            pytest.fail(f"uvicorn exited before it started: {task.exception()!r}")
        return server.started

    await eventually(started, timeout=60, what="uvicorn started")  # a hang guard
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture(scope="session")
async def api_server(engine_settings, ingested, inprocess_engine, tmp_path_factory, sample_corpus):
    """Base URL of `mmrag serve`'s app on 127.0.0.1, on a copy of the session data dir."""
    from mmrag.wiring import create_app

    data = tmp_path_factory.mktemp("api-data")
    copy_corpus(engine_settings, data)
    root = tmp_path_factory.mktemp("ingest-root")
    settings = engine_settings.replace(**{
        "data_dir": data, "api_key": API_KEY, "ingest_root": root, "answer_max_tokens": 8, "warm_top": 4,
        "max_images_per_prompt": 6,  # the union of a two-part question fits; four question images leave room for 2
    })
    app = create_app(settings, engine=inprocess_engine, store=inprocess_engine.features.store)
    async with serving(app) as url:
        yield {"url": url, "app": app, "root": root, "settings": settings}


# --- vision_server: one `mmrag vision serve` process per session (tests/test_vision_service.py) -----------

VISION_ENV = dict(
    MMRAG_VISION_MAX_WAIT_MS="200",  # wide enough that concurrent test callers surely meet in one batch
    MMRAG_MAX_IMAGE_BYTES=str(4 * 1024 * 1024),  # an oversize upload is cheap to send
)


@pytest.fixture(scope="session")
def vision_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Base URL and data dir (its disk feature store) of a real vision service process of the tiny model."""
    from serving.vision.launch import start_vision_service

    data_dir = tmp_path_factory.mktemp("vision-data")
    port = free_port()
    proc = start_vision_service(tiny_model, data_dir, port, data_dir / "server.log", timeout_s=120, **VISION_ENV,
                                MMRAG_VISION_DTYPE="float32")
    url = f"http://127.0.0.1:{port}"
    try:
        yield {"url": url, "data_dir": data_dir, "max_image_bytes": int(VISION_ENV["MMRAG_MAX_IMAGE_BYTES"])}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def record_batches(monkeypatch: pytest.MonkeyPatch, client) -> list[list]:
    """Every ``query_batch_points`` call ``client`` makes from now on, as the list of its requests (each a Qdrant
    round trip): what the retrieval tests count."""
    calls: list[list] = []
    real = client.query_batch_points

    async def spy(collection_name, requests, **kwargs):
        calls.append(list(requests))
        return await real(collection_name, requests=requests, **kwargs)

    monkeypatch.setattr(client, "query_batch_points", spy)
    return calls

