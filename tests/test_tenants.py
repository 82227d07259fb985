"""Tenants: keys map to tenants (stored hashed, compared in constant time); each tenant has its own collection and
sees, searches, cites and deletes only its own documents, jobs and conversations; image-token entries are shared
by content key only, and KV prefixes not at all (each tenant's plans carry its cache salt).

The server is the session engine's, with its own data dir (index, jobs, uploads) and two tenants; every document
it ingests is an image made here with a random mark, so its feature entries are new ones and the test deletes
them again."""

from __future__ import annotations

import hmac
import io
import json
import logging
import uuid

import httpx
import pytest
from PIL import Image, ImageDraw, ImageFont

from mmrag.core.engine import PromptPlan, SamplingSpec
from mmrag.core.keys import ImageKey
from mmrag.core.settings import Settings
from serving.api.tenants import TenantKeys, TenantsFileError, add_key, key_digest, read_tenants, remove_tenant
from tests.conftest import serving
from tests.waiting import ingest_finished

TENANTS = ("acme", "globex")


def _png(label: str) -> bytes:
    """A page of its own: a random mark makes its pixels (and so its content key) new to every store."""
    image = Image.new("RGB", (448, 448), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=32)  # large enough that OCR reads it: the page's text for retrieval
    draw.text((20, 30), f"{label} quarterly", fill="black", font=font)
    draw.text((20, 80), uuid.uuid4().hex[:12], fill="black", font=font)
    draw.rectangle((60, 160, 380, 400), outline="black", width=3)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
async def tenant_server(engine_settings, ingested, inprocess_engine, tmp_path_factory):
    from mmrag import wiring

    data = tmp_path_factory.mktemp("tenants-data")
    tenants_file = data / "tenants.json"
    keys = {t: add_key(tenants_file, t) for t in TENANTS}
    settings = engine_settings.replace(**{
        "data_dir": data, "tenants_file": tenants_file, "api_key": "", "warm_top": 0, "answer_max_tokens": 8,
        "ocr": True,  # the pages' words are what a question finds them by
        "ingest_root": tmp_path_factory.mktemp("tenants-root"),
    })
    store = inprocess_engine.features.store  # what the session engine reads: questions here are answered
    app = wiring.create_app(settings, engine=inprocess_engine, store=store)
    async with serving(app) as url:
        clients = {t: httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {k}"}, timeout=300)
                   for t, k in keys.items()}
        shared = _png("shared")
        docs = {t: {"own": await _upload(clients[t], f"{t}.png", _png(t)),
                    "shared": await _upload(clients[t], "shared.png", shared)} for t in TENANTS}
        try:
            yield {"url": url, "app": app, "keys": keys, "http": clients, "docs": docs, "store": store,
                   "settings": settings}
        finally:
            for client in clients.values():
                await client.aclose()
            for k in keys.values():  # leave no entry of ours in the session's store (on fresh connections)
                async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {k}"},
                                             timeout=300) as client:
                    for d in (await client.get("/v1/documents", params={"limit": 1000})).json()["documents"]:
                        await client.delete(f"/v1/documents/{d['doc_id']}")


async def _job_while(http: httpx.AsyncClient, job_id: str, statuses: tuple[str, ...], *, within_s: float = 120
                     ) -> dict:
    """The job once its status is none of ``statuses``; fails the test after ``within_s`` (a hang guard, not a
    speed check)."""
    return await ingest_finished(http, job_id, timeout=within_s, unfinished=statuses)


async def _upload(http: httpx.AsyncClient, name: str, body: bytes) -> dict:
    r = await http.post("/v1/documents", files={"file": (name, body, "image/png")})
    assert r.status_code == 202, r.text
    out = r.json()
    job = await _job_while(http, out["job"]["id"], ("queued", "running"))
    assert job["status"] == "done" and job["report"]["pages"] == 1, job
    doc = next(d for d in (await http.get("/v1/documents")).json()["documents"] if d["doc_id"] == out["doc_id"])
    return {**out, "page_id": doc["pages"][0]["page_id"], "job_id": out["job"]["id"]}


# --- keys ---------------------------------------------------------------------------------------------------


def test_the_tenants_file_holds_digests_never_keys(tenant_server):
    text = tenant_server["settings"].tenants.file.read_text()
    for tenant, key in tenant_server["keys"].items():
        assert key not in text and key_digest(key) in json.loads(text)[tenant]
    assert oct(tenant_server["settings"].tenants.file.stat().st_mode & 0o777) == "0o600"


def test_a_key_is_compared_with_every_digest_in_constant_time(monkeypatch):
    keys = TenantKeys((("sha256:" + "0" * 64, "a"), (key_digest("k-b"), "b"), ("sha256:" + "1" * 64, "c")))
    calls = []
    real = hmac.compare_digest

    def counted(x, y):
        calls.append(y)
        return real(x, y)

    monkeypatch.setattr(hmac, "compare_digest", counted)
    assert keys.tenant_of("k-b") == "b" and len(calls) == 3  # no early exit on the match
    calls.clear()
    assert keys.tenant_of("k-x") is None and len(calls) == 3
    assert TenantKeys.from_settings(Settings(api_key="k").api_service).tenant_of("k") == "default"
    assert TenantKeys.from_settings(Settings(api_key="k").api_service).tenant_of("kk") is None
    assert TenantKeys.from_settings(Settings().api_service).tenant_of("") == "default"  # no key configured: open


def test_a_bad_tenants_file_names_the_fix(tmp_path):
    path = tmp_path / "tenants.json"
    with pytest.raises(TenantsFileError, match="mmrag tenant add"):
        read_tenants(path)
    path.write_text('{"acme": ["mmrag-plaintext-key"]}')
    with pytest.raises(TenantsFileError, match="never plain keys"):
        read_tenants(path)
    path.write_text('{"Bad Name": []}')
    with pytest.raises(TenantsFileError, match="lowercase"):
        read_tenants(path)
    path.write_text("{")
    with pytest.raises(TenantsFileError, match="cannot read"):
        read_tenants(path)
    path.unlink()
    add_key(path, "acme")
    assert remove_tenant(path, "acme") and read_tenants(path) == {} and not remove_tenant(path, "acme")
    with pytest.raises(ValueError, match="unset MMRAG_API_KEY"):
        Settings(api_key="k", tenants_file=path)


async def test_a_wrong_or_missing_key_is_refused(tenant_server):
    async with httpx.AsyncClient(base_url=tenant_server["url"]) as anon:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"X-API-Key": "nope"}):
            r = await anon.get("/v1/documents", headers=headers)
            assert r.status_code == 401 and "mmrag tenant add" in r.json()["error"]["fix"], r.text
        r = await anon.get("/v1/documents", headers={"X-API-Key": tenant_server["keys"]["acme"]})
        assert r.status_code == 200


async def test_readyz_answers_anyone_without_counting_the_tenants(tenant_server):
    async with httpx.AsyncClient(base_url=tenant_server["url"]) as anon:
        r = await anon.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True, r.text
    assert r.json()["checks"]["qdrant"]["detail"] == "answers" and "collection" not in r.text


# --- isolation ------------------------------------------------------------------------------------------------


async def test_a_tenant_lists_and_reads_only_its_own_documents_and_jobs(tenant_server):
    http, docs = tenant_server["http"], tenant_server["docs"]
    for me, other in (TENANTS, TENANTS[::-1]):
        listed = (await http[me].get("/v1/documents")).json()
        assert {d["doc_id"] for d in listed["documents"]} == {docs[me]["own"]["doc_id"], docs[me]["shared"]["doc_id"]}
        assert listed["total"] == 2
        theirs = docs[other]["own"]
        for path in (f"/v1/pages/{theirs['page_id']}", f"/v1/pages/{theirs['page_id']}/image"):
            r = await http[me].get(path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_page", (path, r.text)
        assert (await http[me].get(f"/v1/pages/{docs[me]['own']['page_id']}")).status_code == 200
        jobs = (await http[me].get("/v1/ingest")).json()["jobs"]
        assert {j["id"] for j in jobs} == {docs[me]["own"]["job_id"], docs[me]["shared"]["job_id"]}
        for path in (f"/v1/ingest/{theirs['job_id']}", f"/v1/ingest/{theirs['job_id']}/cancel"):
            r = await (http[me].get(path) if path.endswith(theirs["job_id"]) else http[me].post(path))
            assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_job", (path, r.text)


async def test_a_tenant_cannot_delete_another_tenants_document(tenant_server):
    http, docs = tenant_server["http"], tenant_server["docs"]
    theirs = docs["globex"]["own"]
    r = await http["acme"].delete(f"/v1/documents/{theirs['doc_id']}")
    assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_document", r.text
    assert theirs["doc_id"] in {d["doc_id"] for d in (await http["globex"].get("/v1/documents")).json()["documents"]}
    assert (await http["globex"].get(f"/v1/pages/{theirs['page_id']}")).status_code == 200


async def test_search_and_citations_stay_in_the_tenants_collection(tenant_server):
    http, docs = tenant_server["http"], tenant_server["docs"]
    for me, other in (TENANTS, TENANTS[::-1]):
        mine = {docs[me][k]["page_id"] for k in ("own", "shared")}
        # Asked about the other tenant's page by its words, and by its file name as a filter.
        r = await http[me].post("/v1/ask", json={"question": f"What does the {other} quarterly figure show?"})
        assert r.status_code == 200, r.text
        cited = {c["page_id"] for c in r.json()["citations"]}
        assert cited and cited <= mine, (cited, mine, r.json())
        r = await http[me].post("/v1/ask", json={"question": "What does it show?", "docs": [f"{other}.png"]})
        assert r.status_code != 200 or not r.json()["citations"], r.text
        r = await http[me].post("/v1/chat/completions", json={
            "model": "mmrag", "messages": [{"role": "user", "content": f"What is in {other}.png?"}]})
        assert r.status_code == 200, r.text
        assert {c["page_id"] for c in r.json()["citations"]} <= mine


async def test_a_conversation_id_is_the_tenants_own(tenant_server):
    http = tenant_server["http"]
    import base64

    image = base64.b64encode(_png("question")).decode()
    r = await http["acme"].post("/v1/ask", json={"question": "What does this figure show?",
                                                          "images": [{"data": image}]})
    assert r.status_code == 200, r.text
    conversation = r.json()["conversation_id"]
    r = await http["globex"].post("/v1/ask", json={"question": "And then?", "conversation_id": conversation})
    assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_conversation", r.text
    r = await http["acme"].post("/v1/ask", json={"question": "And then?", "conversation_id": conversation})
    assert r.status_code == 200, r.text


# --- what tenants share ----------------------------------------------------------------------------------------


async def test_a_shared_figure_is_one_entry_kept_until_no_tenant_references_it(tenant_server):
    http, docs, store = tenant_server["http"], tenant_server["docs"], tenant_server["store"]
    pages = {t: (await http[t].get(f"/v1/pages/{docs[t]['shared']['page_id']}")).json() for t in TENANTS}
    keys = {ImageKey.parse(p["image_key"]) for p in pages.values()}
    assert len(keys) == 1 and store.contains(next(iter(keys)))  # one content key, one entry, two tenants
    key = keys.pop()
    first = await http["acme"].delete(f"/v1/documents/{docs['acme']['shared']['doc_id']}")
    assert first.status_code == 200 and first.json()["pages"] == 1, first.text
    assert store.contains(key)  # globex's page still needs it
    assert (await http["globex"].get(f"/v1/pages/{docs['globex']['shared']['page_id']}")).status_code == 200
    last = await http["globex"].delete(f"/v1/documents/{docs['globex']['shared']['doc_id']}")
    assert last.status_code == 200 and last.json()["pages"] == 1, last.text
    assert not store.contains(key)


async def test_a_deletion_tells_a_tenant_nothing_of_another_tenants_pages(tenant_server, caplog):
    """Issue 24's probe: acme uploads and deletes a page; globex uploads the same bytes; acme uploads and deletes
    it again. Both deletions answer alike (they said `entries_removed 1, entries_kept 0`, then `0, 1`: "another
    tenant has this exact page"); the server logs what happened to the shared entry instead."""
    http, store = tenant_server["http"], tenant_server["store"]
    caplog.set_level(logging.INFO, logger="serving.ingest_jobs")
    body = _png("probe")
    answers = []
    for other_holds_it in (False, True):
        if other_holds_it:
            theirs = await _upload(http["globex"], "probe.png", body)
        mine = await _upload(http["acme"], "probe.png", body)
        r = await http["acme"].delete(f"/v1/documents/{mine['doc_id']}")
        assert r.status_code == 200, r.text
        answers.append(r.json())
    assert answers[0] == answers[1] == {"doc_id": mine["doc_id"], "doc": "probe.png", "pages": 1}
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("deleted document")]
    assert [("1 removed, 0 kept for other" in m, "0 removed, 1 kept for other" in m) for m in logged] == [
        (True, False), (False, True)], logged
    page = (await http["globex"].get(f"/v1/pages/{theirs['page_id']}")).json()
    assert store.contains(ImageKey.parse(page["image_key"]))  # globex's page still has its tokens
    r = await http["globex"].delete(f"/v1/documents/{theirs['doc_id']}")
    assert r.status_code == 200 and not store.contains(ImageKey.parse(page["image_key"]))


async def _salts_isolate(engine, key: ImageKey) -> None:
    """The same page, prefilled for one salt, is a miss for another (and for the unsalted default tenant),
    then a hit for each."""
    await engine.reset_prefix_cache()

    async def cached(salt: str) -> int:
        plan = PromptPlan(images=(key,), text="tenant probe", sampling=SamplingSpec(max_tokens=1), cache_salt=salt)
        return (await engine.generate(plan)).usage.cached_image_tokens

    assert await cached("tenant-acme") == 0
    assert await cached("tenant-acme") > 0
    assert await cached("tenant-globex") == 0
    assert await cached("") == 0
    assert await cached("tenant-globex") > 0 and await cached("") > 0


async def test_tenants_never_share_kv_prefixes_in_process(tenant_server, inprocess_engine):
    page = (await tenant_server["http"]["acme"].get(f"/v1/pages/{tenant_server['docs']['acme']['own']['page_id']}"))
    await _salts_isolate(inprocess_engine, ImageKey.parse(page.json()["image_key"]))


async def test_tenants_never_share_kv_prefixes_on_a_vllm_serve_replica(engine_settings, vllm_server):
    from mmrag.wiring import feature_store, resolve_model
    from serving.engine.features import FeatureProvider
    from serving.engine.remote import RemoteEngine

    store = feature_store(engine_settings)
    engine = RemoteEngine([vllm_server], resolve_model(engine_settings), FeatureProvider.unscoped(store))
    try:
        page = next(k for k in sorted(store.keys()) if k.policy == engine_settings.vision.resolution_policy)
        await _salts_isolate(engine, page)  # an ingested page: the replica gets its tokens
    finally:
        await engine.close()


@pytest.mark.parametrize("mode", ["joint", "split"])
async def test_each_tenants_questions_carry_its_salt(tenant_server, monkeypatch, mode):
    """What reaches the engine from a tenant's question, in either answer mode: every plan with its salt."""
    services = tenant_server["app"].state.services
    seen: list[PromptPlan] = []
    generate = services.engine.generate

    async def spy(plan, **kw):
        seen.append(plan)
        return await generate(plan, **kw)

    monkeypatch.setattr(services.engine, "generate", spy)  # the scheduler's engine: every tenant's
    for tenant in TENANTS:
        assert services.tenants[tenant].pipeline.searcher.collection == f"mmrag_pages--{tenant}"
        seen.clear()
        r = await tenant_server["http"][tenant].post("/v1/ask", json={
            "question": "What does the figure show and what is the trend?", "answer_mode": mode})
        assert r.status_code == 200, r.text
        # Split over one page is one prompt, the joint one: the tenant's corpus may hold one page for it.
        assert r.json()["answer_mode"] == mode or (mode == "split" and len(r.json()["citations"]) == 1), r.text
        assert seen and {p.cache_salt for p in seen} == {f"tenant-{tenant}"}


async def test_server_side_ingest_reads_the_tenants_own_root_and_a_running_job_can_be_cancelled(tenant_server):
    http, root = tenant_server["http"], tenant_server["settings"].api.ingest_root
    folder = root / "acme"
    folder.mkdir()
    for i in range(24):  # OCR'd one by one: long enough to be caught running
        (folder / f"page-{i:02d}.png").write_bytes(_png(f"acme batch {i}"))
    r = await http["globex"].post("/v1/ingest", json={"paths": ["../acme"]})
    assert r.status_code == 403 and "MMRAG_INGEST_ROOT/globex" in r.json()["error"]["message"], r.text

    job = (await http["acme"].post("/v1/ingest", json={"paths": ["."]})).json()
    assert job["paths"] == ["."], job  # shown relative to the tenant's root
    state = await _job_while(http["acme"], job["id"], ("queued",))
    assert state["status"] == "running", state
    cancelled = (await http["acme"].post(f"/v1/ingest/{job['id']}/cancel")).json()
    assert cancelled["status"] in ("cancelling", "cancelled"), cancelled
    state = await _job_while(http["acme"], job["id"], ("cancelling",))
    assert state["status"] == "cancelled", state
    indexed = {d["doc"] for d in (await http["acme"].get("/v1/documents")).json()["documents"]}
    batch = {p.name for p in folder.iterdir()}
    assert len(indexed & batch) < len(batch)  # it stopped before the end; what it indexed stays
    again = (await http["acme"].post("/v1/ingest", json={"paths": ["."]})).json()
    state = await _job_while(http["acme"], again["id"], ("queued", "running"), within_s=300)
    assert state["status"] == "done", state
    indexed = {d["doc"] for d in (await http["acme"].get("/v1/documents", params={"limit": 100})).json()["documents"]}
    assert batch <= indexed  # re-submitting finished the rest


async def test_an_upload_ingestion_refuses_leaves_no_file_behind(tenant_server):
    http, settings = tenant_server["http"]["acme"], tenant_server["settings"]
    r = await http.post("/v1/documents", files={"file": ("broken.png", b"\x89PNG\r\n\x1a\n" + bytes(64), "image/png")})
    assert r.status_code == 202, r.text
    job = await _job_while(http, r.json()["job"]["id"], ("queued", "running"))
    assert job["status"] == "done" and [f["path"] for f in job["report"]["failed"]] == ["broken.png"], job
    uploads = settings.storage.data_dir / "uploads" / "tenants" / "acme"
    assert not list(uploads.glob(f"{r.json()['sha256'][:16]}*")), list(uploads.iterdir())


# --- the command line ------------------------------------------------------------------------------------------


def test_the_cli_makes_keys_and_ingests_into_a_tenants_collection(engine_settings, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from mmrag import cli

    tenants_file = tmp_path / "tenants.json"
    monkeypatch.setenv("MMRAG_TENANTS_FILE", str(tenants_file))
    monkeypatch.setenv("MMRAG_MODEL", engine_settings.model.name)
    monkeypatch.setenv("MMRAG_DATA_DIR", str(tmp_path / "data"))
    runner = CliRunner()
    made = runner.invoke(cli.app, ["tenant", "add", "acme"])
    assert made.exit_code == 0, made.output
    key = made.stdout.strip().splitlines()[-1]
    assert key.startswith("mmrag-") and TenantKeys.from_settings(Settings().api_service).tenant_of(key) == "acme"
    assert key not in tenants_file.read_text()
    listed = runner.invoke(cli.app, ["tenant", "list", "--json"])
    assert json.loads(listed.stdout) == {"acme": {"keys": 1, "collection": "mmrag_pages--acme"}}

    page = tmp_path / "acme.png"
    page.write_bytes(_png("acme"))
    ingested = runner.invoke(cli.app, ["ingest", str(page), "--tenant", "acme", "--json"])
    assert ingested.exit_code == 0, ingested.output
    assert json.loads(ingested.stdout.strip().splitlines()[-1])["pages"] == 1
    assert json.loads(runner.invoke(cli.app, ["index", "stats", "--tenant", "acme"]).stdout)["pages"] == 1
    assert json.loads(runner.invoke(cli.app, ["index", "stats"]).stdout)["pages"] == 0  # the default tenant's
    bad = runner.invoke(cli.app, ["index", "stats", "--tenant", "Acme!"])
    assert bad.exit_code == 2 and "lowercase" in bad.output
