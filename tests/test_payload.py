"""The one typed page payload: what ingest writes is what every reader reads back, field for field."""

from __future__ import annotations

import dataclasses

import pytest

from mmrag.adapters.qdrant import AsyncPageReader, open_async_qdrant
from mmrag.core.keys import ImageKey
from mmrag.core.pages import TextSource
from mmrag.core.settings import Settings
from mmrag.core.payload import FIELD_NAMES, PagePayload, PayloadError
from mmrag import wiring
from mmrag.ask_cmd import lookup_pages

KEY = ImageKey.parse(f"img1-{'d' * 64}-{'ab' * 8}-px3136-200704")


def sample() -> PagePayload:
    return PagePayload(doc_id="0123456789abcdef", doc="a.pdf", path="/x/a.pdf", page=2, num_pages=3,
                       file_sha256="f" * 64, content_hash=KEY.content_hash, image_key=KEY, image_tokens=247,
                       width=1123, height=794, text="Retry limit: 5.", text_source=TextSource.TEXT_LAYER,
                       fingerprint="enc=ab|px")


def test_the_qdrant_form_round_trips_and_is_plain_json():
    import json

    page = sample()
    stored = json.loads(json.dumps(page.to_qdrant()))
    assert set(stored) == set(FIELD_NAMES)
    assert PagePayload.from_qdrant(stored) == page


def test_a_payload_from_another_version_is_refused_with_the_fix():
    stored = sample().to_qdrant()
    del stored["fingerprint"]
    with pytest.raises(PayloadError, match="mmrag index reset"):
        PagePayload.from_qdrant(stored)
    with pytest.raises(PayloadError, match="malformed"):
        PagePayload.from_qdrant({**sample().to_qdrant(), "image_key": "not-a-key"})


@pytest.fixture(scope="module")
def ingested_one(tmp_path_factory, tiny_model, sample_corpus):
    """One PDF ingested into a fresh data dir (its own Qdrant folder: local mode is one client per folder)."""
    settings = Settings(model=str(tiny_model), data_dir=tmp_path_factory.mktemp("payload"), ocr=False)
    ingestor = wiring.ingestor(settings)
    try:
        report = ingestor.run([sample_corpus / "operations_manual.pdf"])
        written = ingestor.index.pages()
    finally:
        ingestor.index.client.close()
    assert not report.failed and len(written) == report.pages > 1
    return settings, sorted(written, key=lambda p: p.page)


def test_ingest_writes_a_complete_payload_that_names_stored_tokens(ingested_one):
    settings, pages = ingested_one
    store = wiring.feature_store(settings)
    for p in pages:
        assert p.doc == "operations_manual.pdf" and p.num_pages == len(pages)
        assert p.image_key.content_hash == p.content_hash
        assert store.get(p.image_key).num_tokens == p.image_tokens
        assert (p.text_source is TextSource.TEXT_LAYER) == bool(p.text)  # OCR is off: a scanned page has none
    assert any(p.text for p in pages)


def test_every_sync_reader_returns_the_same_payload(ingested_one):
    settings, pages = ingested_one
    index = wiring.read_index(settings)
    try:
        assert index.doc_pages(pages[0].doc_id) == pages
        assert [index.find_page(p.doc, p.page) for p in pages] == pages
        assert [index.find_page(p.doc_id, p.page) for p in pages] == pages
        assert lookup_pages(index, [(p.doc, p.page) for p in pages]) == pages
    finally:
        index.client.close()


async def test_every_async_reader_returns_the_same_payload(ingested_one):
    settings, pages = ingested_one
    client = open_async_qdrant("", settings.storage.qdrant_path)
    try:
        reader = AsyncPageReader(client, settings.storage.qdrant_collection)
        assert sorted(await reader.pages(), key=lambda p: p.page) == pages
        assert [await reader.get(p.page_id) for p in pages] == pages
        searcher = wiring.searcher(settings, client=client)
        text = next(p.text for p in pages if p.text)
        hits = await searcher.search(text[:80], top_k=len(pages))
        by_id = {p.page_id: p for p in pages}
        assert hits
        for hit in hits:
            page = by_id[hit.page_id]
            assert (hit.doc_id, hit.doc, hit.page, hit.image_key, hit.image_tokens, hit.path, hit.text) == (
                page.doc_id, page.doc, page.page, page.image_key, page.image_tokens, page.path, page.text)
    finally:
        await client.close()


def test_no_module_outside_the_contract_spells_a_payload_key():
    """Payload keys live in mmrag/core/payload.py; readers go through PagePayload or PageField."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    keys = [f.name for f in dataclasses.fields(PagePayload) if f.name not in ("page", "doc", "text", "path")]
    pattern = re.compile(r"""payload\[["'](%s)["']\]""" % "|".join(keys))
    service = ("ingestion", "retrieval", "rag", "serving", "mmrag")  # mmrag: its adapters and composition root
    apart = [repo / "mmrag" / d for d in ("core", "bench", "devkit")]  # the contract itself; benchmarks; dev kit
    offenders = [str(p.relative_to(repo)) for pkg in service for p in (repo / pkg).rglob("*.py")
                 if not any(p.is_relative_to(d) for d in apart) and pattern.search(p.read_text(encoding="utf-8"))]
    assert not offenders
