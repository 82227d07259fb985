"""POST/GET/DELETE /v1/documents on their own app over a copy of the session corpus (a deletion must not
reach the index and store other tests read): uploads are stored by content under the data dir whatever the
client names them, limited in size and type, ingested as a job; a deletion keeps the figures other documents
share; the listing paginates."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from mmrag.adapters.store import DiskFeatureStore
from mmrag.core.keys import ImageKey
from tests.conftest import API_KEY, copy_corpus, serving
from tests.waiting import ingest_finished

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
async def docs_app(engine_settings, ingested, inprocess_engine, tmp_path_factory, sample_corpus):
    from mmrag import wiring

    data = tmp_path_factory.mktemp("documents-data")
    copy_corpus(engine_settings, data)
    upload = sorted(sample_corpus.glob("*.png"))[0]
    settings = engine_settings.replace(**{
        "data_dir": data, "api_key": API_KEY, "warm_top": 0, "max_upload_bytes": upload.stat().st_size + 100,
    })
    # The engine is the session's (nothing here asks a question); the store is the copy's, which deletes act on.
    app = wiring.create_app(settings, engine=inprocess_engine, store=wiring.feature_store(settings))
    async with serving(app) as url, httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
        yield {"http": http, "settings": settings, "upload": upload}


async def _done(http: httpx.AsyncClient, job_id: str) -> dict:
    return await ingest_finished(http, job_id, timeout=120)  # a hang guard


async def _all_documents(http: httpx.AsyncClient) -> list[dict]:
    return (await http.get("/v1/documents", params={"limit": 1000})).json()["documents"]


async def test_an_upload_is_stored_by_content_under_a_safe_name_and_ingested_as_a_job(docs_app):
    http, settings, upload = docs_app["http"], docs_app["settings"], docs_app["upload"]
    body = upload.read_bytes()
    r = await http.post("/v1/documents", files={"file": ("../../etc/evil name.png", body, "image/png")})
    assert r.status_code == 202, r.text
    out = r.json()
    stored = list((settings.storage.data_dir / "uploads").glob("*/*"))
    assert [p.relative_to(settings.storage.data_dir).as_posix() for p in stored] == [
        f"uploads/{out['sha256'][:16]}/etc_evil_name.png"]
    assert stored[0].read_bytes() == body and out["bytes"] == len(body)
    assert out["job"]["paths"] == ["etc_evil_name.png"]  # no server folder in what the client sees
    job = await _done(http, out["job"]["id"])
    assert job["status"] == "done" and job["report"]["failed"] == [] and job["report"]["pages"] == 1, job
    listed = {d["doc_id"]: d for d in await _all_documents(http)}
    assert listed[out["doc_id"]]["doc"] == "etc_evil_name.png"

    deleted = await http.delete(f"/v1/documents/{out['doc_id']}")
    # The same pixels are a page of the corpus, so its feature entry stays for that page.
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"doc_id": out["doc_id"], "doc": "etc_evil_name.png", "pages": 1}  # its own index only
    assert not stored[0].exists() and out["doc_id"] not in {d["doc_id"] for d in await _all_documents(http)}


async def test_uploads_over_the_size_limit_or_of_an_unread_type_are_refused_and_leave_nothing(docs_app):
    http, settings = docs_app["http"], docs_app["settings"]
    big = b"\x89PNG\r\n\x1a\n" + bytes(settings.api.max_upload_bytes)
    r = await http.post("/v1/documents", files={"file": ("big.png", big, "image/png")})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    assert "MMRAG_MAX_UPLOAD_BYTES" in r.json()["error"]["fix"]
    r = await http.post("/v1/documents", files={"file": ("notes.pdf", b"#!/bin/sh\necho hi\n", "application/pdf")})
    assert r.status_code == 415 and r.json()["error"]["type"] == "unsupported_type", r.text
    assert r.json()["error"]["fix"]
    r = await http.post("/v1/documents", data={"other": "x"})
    assert r.status_code == 422, r.text
    assert list((settings.storage.data_dir / "uploads").glob("**/*.*")) == []  # no temp file or stored file stays


async def test_deleting_a_document_keeps_the_figures_another_document_shares(docs_app):
    http, settings = docs_app["http"], docs_app["settings"]
    docs = await _all_documents(http)
    keys: dict[str, set[str]] = {}
    for d in docs:
        pages = [(await http.get(f"/v1/pages/{p['page_id']}")).json() for p in d["pages"]]
        keys[d["doc_id"]] = {p["image_key"] for p in pages}
    uses = Counter(k for ks in keys.values() for k in ks)
    # A document with a page another document shares (pixel-identical slides) and one only it has.
    victim = next(d for d in docs if any(uses[k] > 1 for k in keys[d["doc_id"]])
                  and any(uses[k] == 1 for k in keys[d["doc_id"]]))
    shared = {k for k in keys[victim["doc_id"]] if uses[k] > 1}
    own = keys[victim["doc_id"]] - shared
    store = DiskFeatureStore(settings.storage.features_dir)
    assert all(store.contains(ImageKey.parse(k)) for k in keys[victim["doc_id"]])

    r = await http.delete(f"/v1/documents/{victim['doc_id']}")
    assert r.status_code == 200, r.text
    assert r.json() == {"doc_id": victim["doc_id"], "doc": victim["doc"], "pages": victim["indexed_pages"]}
    assert [k for k in shared if not store.contains(ImageKey.parse(k))] == []  # the other document still shows it
    assert [k for k in own if store.contains(ImageKey.parse(k))] == []
    left = await _all_documents(http)
    assert victim["doc_id"] not in {d["doc_id"] for d in left} and len(left) == len(docs) - 1
    gone = await http.get(f"/v1/pages/{victim['pages'][0]['page_id']}")
    assert gone.status_code == 404
    again = await http.delete(f"/v1/documents/{victim['doc_id']}")
    assert again.status_code == 404 and again.json()["error"]["type"] == "unknown_document", again.text


async def test_the_document_listing_paginates_with_limit_offset_and_next_offset(docs_app):
    http = docs_app["http"]
    everything = await _all_documents(http)
    assert len(everything) >= 3
    seen, offset, pages = [], 0, 0
    while offset is not None:
        page = (await http.get("/v1/documents", params={"limit": 2, "offset": offset})).json()
        assert page["total"] == len(everything) and len(page["documents"]) <= 2
        seen += page["documents"]
        offset, pages = page["next_offset"], pages + 1
    assert seen == everything and pages == -(-len(everything) // 2)
    r = await http.get("/v1/documents", params={"limit": 0})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request"


async def test_a_wrong_method_on_a_shared_path_names_every_method_of_that_path(docs_app):
    r = await docs_app["http"].request("OPTIONS", "/v1/documents")
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST", r.headers
    assert r.json()["error"]["type"] == "method_not_allowed"
