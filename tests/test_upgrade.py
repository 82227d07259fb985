"""Upgrade safety: pages whose image tokens another encoder made are counted, never served, and collectable.

"Another encoder" is the simplest real one: a changed MMRAG_ENCODER_SALT (it changes the encoder version as
a model or projector upgrade does). A copy of the session corpus gets one document re-ingested under a new
salt; the configured encoder stays the session's, so the session engine (which reads the session store)
serves the other pages, and every key it loads is recorded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator

import httpx
import pytest
from qdrant_client import models
from typer.testing import CliRunner

from mmrag.adapters.qdrant import IndexConfigError
from mmrag.adapters.store import DiskFeatureStore, FeatureStore, RedisFeatureStore, StaleFeaturesError
from mmrag.core.keys import EncoderVersion, ImageKey
from mmrag.core.payload import EncoderScope, PageField, PayloadError
from mmrag import store_cmd, wiring
from mmrag.cli import app
from retrieval.search import StaleIndexError
from serving.engine.features import FeatureProvider
from tests.conftest import copy_corpus, serving

UPGRADED_DOC = "operations_manual.pdf"
NEW_SALT = "upgrade-test"
runner = CliRunner()


@pytest.fixture(scope="module")
def upgraded(engine_settings, ingested, sample_corpus, tmp_path_factory):
    """A copy of the session corpus with UPGRADED_DOC re-ingested under NEW_SALT: its pages now carry keys
    of another encoder than the configured (session) one, its old entries stay in the store."""
    data = tmp_path_factory.mktemp("upgrade-data")
    copy_corpus(engine_settings, data)
    settings = engine_settings.replace(**{"data_dir": data})
    before = _pages(settings)
    ingestor = wiring.ingestor(settings.replace(**{"encoder_salt": NEW_SALT}))
    try:
        report = ingestor.run([sample_corpus / UPGRADED_DOC])
    finally:
        ingestor.index.client.close()
    assert not report.failed and report.pages > 0
    model = wiring.resolve_model(settings)
    old = wiring.encoder_scope(settings, model)
    new = wiring.encoder_scope(settings.replace(**{"encoder_salt": NEW_SALT}), model)
    assert old != new and old.policy == new.policy
    return {"settings": settings, "before": before, "after": _pages(settings), "old": old, "new": new,
            "upgraded_pages": report.pages}


def _pages(settings):
    index = wiring.read_index(settings)
    try:
        return index.pages()
    finally:
        index.client.close()


def _env(settings, **extra: str) -> dict[str, str]:
    return {"MMRAG_DATA_DIR": str(settings.storage.data_dir), "MMRAG_MODEL": settings.model.name,
            "MMRAG_ENCODER_SALT": "",
            "MMRAG_REDIS_URL": "", **extra}


def test_index_check_counts_pages_per_encoder_and_says_which_are_served(upgraded):
    settings, old, new, n_new = upgraded["settings"], upgraded["old"], upgraded["new"], upgraded["upgraded_pages"]
    total = len(upgraded["before"])
    assert len(upgraded["after"]) == total
    for salt, serving_, stale in (("", old, n_new), (NEW_SALT, new, total - n_new)):
        result = runner.invoke(app, ["index", "check", "--json"], env=_env(settings, MMRAG_ENCODER_SALT=salt))
        assert result.exit_code == 1, result.output  # some pages cannot be served
        out = json.loads(result.stdout)
        assert out["serving"] == {"encoder_version": serving_.version, "policy": str(serving_.policy),
                                  "family": "qwen2_vl"}
        assert (out["pages"], out["stale_pages"]) == (total, stale)
        by_version = {e["encoder_version"]: e for e in out["encoders"]}
        assert set(by_version) == {old.version, new.version}
        assert by_version[new.version]["pages"] == n_new and by_version[new.version]["documents"] == 1
        assert by_version[old.version]["pages"] == total - n_new
        assert by_version[serving_.version]["servable"] and sum(e["servable"] for e in out["encoders"]) == 1
        assert out["fix"].startswith("run `mmrag reencode`") and "re-ingest" in out["fix"]
        assert not any(e["old_format"] for e in out["encoders"])  # another salt: another encoder, not an old key
    human = runner.invoke(app, ["index", "check"], env=_env(settings))
    assert human.exit_code == 1 and f"{n_new} of {total} pages cannot be served" in " ".join(human.output.split())


class RecordingStore:
    """The session store, with every key read recorded: what the engine was fed."""

    def __init__(self, inner: FeatureStore) -> None:
        self.inner = inner
        self.backend, self.stats = inner.backend, inner.stats
        self.read: list[ImageKey] = []

    def get(self, key: ImageKey):
        self.read.append(key)
        return self.inner.get(key)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@contextlib.contextmanager
def recording(engine) -> Iterator[RecordingStore]:
    features: FeatureProvider = engine.features
    original = features.store
    features.store = recorder = RecordingStore(original)
    try:
        yield recorder
    finally:
        features.store = original


async def test_ask_retrieves_no_page_of_another_encoder_and_feeds_no_stale_key(upgraded, inprocess_engine):
    settings, old = upgraded["settings"], upgraded["old"]
    stale = {p.image_key for p in upgraded["after"] if not old.covers(p.image_key)}
    question = "What is the retry limit in the operations manual?"
    unscoped = wiring.searcher(settings)  # what retrieval returned before: the stale pages rank high
    try:
        assert {h.image_key for h in await unscoped.search(question, top_k=10)} & stale
    finally:
        await unscoped.client.close()
    pipeline, _ = wiring.pipeline(settings.replace(**{"answer_max_tokens": 4}), inprocess_engine)
    try:
        hits = await pipeline.searcher.search(question, top_k=10)
        assert hits and all(old.covers(h.image_key) for h in hits)
        with recording(inprocess_engine) as recorder:
            answer = await pipeline.ask(question)
        assert answer.citations and recorder.read
        assert all(old.covers(k) for k in recorder.read) and not set(recorder.read) & stale
    finally:
        await pipeline.searcher.client.close()


async def test_asking_within_only_upgraded_documents_finds_no_pages(upgraded):
    """Refusal at question time is exclusion: within the upgraded document alone nothing is found."""
    searcher = wiring.searcher(upgraded["settings"], encoder=upgraded["old"])
    try:
        assert await searcher.search("retry limit", doc_filter=[UPGRADED_DOC]) == []
    finally:
        await searcher.client.close()


async def test_an_index_of_only_other_encoders_pages_is_an_error_naming_the_fix(upgraded):
    unknown = EncoderScope(EncoderVersion("0" * 16), upgraded["old"].policy)
    searcher = wiring.searcher(upgraded["settings"], encoder=unknown)
    try:
        with pytest.raises(StaleIndexError, match=f"all {len(upgraded['after'])} indexed pages.*none can be "
                                                  "served: run `mmrag reencode`"):
            await searcher.search("retry limit")
    finally:
        await searcher.client.close()


async def test_an_engine_refuses_stale_tokens_whatever_names_them(upgraded):
    """`ask --pages` and warm-up name pages directly: the engine's feature provider refuses another encoder's
    keys with the fix, before reading the store."""
    settings, old = upgraded["settings"], upgraded["old"]
    stale = next(p.image_key for p in upgraded["after"] if not old.covers(p.image_key))
    fresh = next(p.image_key for p in upgraded["after"] if old.covers(p.image_key))
    engine = wiring.engine(settings.replace(**{"engine_urls": ["http://127.0.0.1:9"]}),
                           wiring.resolve_model(settings))  # remote: nothing starts until a request
    try:
        recorder = RecordingStore(engine.features.store)
        engine.features.store = recorder
        assert DiskFeatureStore(settings.storage.features_dir).contains(stale)  # its tokens are there, and refused
        with pytest.raises(StaleFeaturesError, match="refusing to feed them: run `mmrag reencode`"):
            await engine.features.load([fresh, stale])
        assert stale not in recorder.read
        assert len(await engine.features.load([fresh])) == 1
    finally:
        await engine.close()


async def test_serve_warns_at_start_up_and_never_feeds_stale_tokens(upgraded, inprocess_engine, caplog):
    settings, old, n_new = upgraded["settings"], upgraded["old"], upgraded["upgraded_pages"]
    total = len(upgraded["after"])
    settings = settings.replace(**{"answer_max_tokens": 4, "warm_top": -1})
    caplog.set_level(logging.WARNING, logger="retrieval.search")
    with recording(inprocess_engine) as recorder:
        app_ = wiring.create_app(settings, engine=inprocess_engine, store=inprocess_engine.features.store.inner)
        async with serving(app_) as url:
            warned = [r.getMessage() for r in caplog.records if "another vision encoder" in r.getMessage()]
            assert len(warned) == 1 and warned[0].startswith(f"{n_new} of {total} indexed pages")
            assert "Fix: run `mmrag reencode`" in warned[0] and "MMRAG_ENCODER_SALT" in warned[0]
            warmed = app_.state.services.warm_report.warmed
            assert warmed and all(old.covers(k) for k in warmed)
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                r = await client.post("/v1/ask", json={"question": "What is the retry limit for operations?"})
                assert r.status_code == 200, r.text
                scraped = (await client.get("/metrics")).text
            policy = str(old.policy)
            assert (f'mmrag_serving_encoder_info{{family="qwen2_vl",policy="{policy}",version="{old.version}"}} 1.0'
                    in scraped)
            new = upgraded["new"].version
            assert (f'mmrag_indexed_pages{{encoder_version="{old.version}",policy="{policy}",servable="true"}} '
                    f'{float(total - n_new)}') in scraped
            assert (f'mmrag_indexed_pages{{encoder_version="{new}",policy="{policy}",servable="false"}} '
                    f'{float(n_new)}') in scraped
    assert recorder.read and all(old.covers(k) for k in recorder.read)


def _expected_garbage(upgraded, stored: set[ImageKey]) -> set[ImageKey]:
    """Independently of gc: the upgraded document's old keys no other page shares, plus anything the index
    never referenced."""
    before = upgraded["before"]
    old_doc = {k for p in before if p.doc == UPGRADED_DOC for k in p.image_keys}  # pages' and figures' entries
    others = {k for p in before if p.doc != UPGRADED_DOC for k in p.image_keys}
    referenced = {k for p in before for k in p.image_keys}
    return (old_doc - others) | (stored - referenced - {k for p in upgraded["after"] for k in p.image_keys})


def _gc_cycle(settings, store: FeatureStore, expected: set[ImageKey]) -> None:
    stored = set(store.keys())
    sizes = {k: store.size(k) for k in expected}
    dry = store_cmd.gc(settings, dry_run=True)
    assert {k for k, _ in dry.unreferenced} == expected and expected
    assert dict(dry.unreferenced) == sizes and dry.bytes == sum(sizes.values())
    assert set(store.keys()) == stored  # a dry run removes nothing
    done = store_cmd.gc(settings, dry_run=False)
    assert {k for k, _ in done.unreferenced} == expected
    assert set(store.keys()) == stored - expected
    assert done.kept == len(stored - expected)
    assert store_cmd.gc(settings, dry_run=True).unreferenced == []


def test_store_gc_removes_exactly_the_unreferenced_entries_on_disk(upgraded, tmp_path):
    settings = upgraded["settings"].replace(**{"data_dir": tmp_path})
    shutil.copytree(upgraded["settings"].storage.data_dir, tmp_path, dirs_exist_ok=True)  # the other tests keep theirs
    store = DiskFeatureStore(settings.storage.features_dir)
    expected = _expected_garbage(upgraded, set(store.keys()))
    result = runner.invoke(app, ["store", "gc", "--json"], env=_env(settings))
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert listed["dry_run"] and {e["key"] for e in listed["would_remove"]} == {str(k) for k in expected}
    _gc_cycle(settings, store, expected)
    for page in upgraded["after"]:  # every indexed page still has its tokens
        assert store.get(page.image_key) is not None


def test_store_gc_removes_exactly_the_unreferenced_entries_in_redis(upgraded, redis_url):
    settings = upgraded["settings"].replace(**{"redis_url": redis_url.rsplit("/", 1)[0] + "/7"})
    disk = DiskFeatureStore(upgraded["settings"].storage.features_dir)
    store = RedisFeatureStore(settings.storage.redis_url)  # a database of its own: other tests use /0
    store.client.flushdb()
    for key in disk.keys():
        store.put(key, disk.get(key))
    _gc_cycle(settings, store, _expected_garbage(upgraded, set(store.keys())))


@pytest.mark.parametrize("backend", ["disk", pytest.param("redis", marks=pytest.mark.server)])
def test_a_store_deletes_one_entry_and_says_how_many_bytes_went(upgraded, backend, tmp_path, request):
    disk = DiskFeatureStore(upgraded["settings"].storage.features_dir)
    key = upgraded["after"][0].image_key
    value = disk.get(key)
    if backend == "disk":
        store: FeatureStore = DiskFeatureStore(tmp_path)
    else:
        store = RedisFeatureStore(request.getfixturevalue("redis_url").rsplit("/", 1)[0] + "/8")
        store.client.flushdb()
    store.put(key, value)
    other = next(p.image_key for p in upgraded["after"] if p.image_key != key)
    store.put(other, disk.get(other))
    size = store.size(key)
    assert size == disk.size(key) and size > 0
    assert store.delete(key) == size
    assert store.get(key) is None and store.size(key) is None and store.delete(key) == 0
    assert set(store.keys()) == {other}  # only that entry went


def test_gc_refuses_to_apply_without_an_index(upgraded, tmp_path):
    """A wrong MMRAG_QDRANT_COLLECTION would make every entry look unreferenced."""
    settings = upgraded["settings"].replace(**{"qdrant_collection": "no_such_collection"})
    with pytest.raises(IndexConfigError, match="refusing"):
        store_cmd.gc(settings, dry_run=False)
    assert set(DiskFeatureStore(settings.storage.features_dir).keys())


def test_an_index_written_before_the_encoder_fields_is_backfilled_by_a_writer(upgraded, tmp_path):
    settings = upgraded["settings"].replace(**{"data_dir": tmp_path})
    shutil.copytree(upgraded["settings"].storage.data_dir / "qdrant", tmp_path / "qdrant")
    index = wiring.read_index(settings)
    try:
        index.client.delete_payload(settings.storage.qdrant_collection, keys=[PageField.ENCODER_VERSION.value,
                                    PageField.RESOLUTION_POLICY.value], points=models.Filter(), wait=True)
        with pytest.raises(PayloadError, match="open it once for writing"):
            index.pages()
        text_dim = index.client.get_collection(settings.storage.qdrant_collection).config.params.vectors["text"].size
    finally:
        index.client.close()
    writer = wiring.page_index(settings, text_dim)  # what `mmrag ingest` opens
    try:
        assert writer.backfill_encoder_fields() == 0  # opening it backfilled every page
        assert sorted(writer.pages(), key=lambda p: p.page_id) == sorted(upgraded["after"], key=lambda p: p.page_id)
    finally:
        writer.client.close()
