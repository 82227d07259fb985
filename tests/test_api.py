"""The REST service on a real port: answers, documents, pages, ingest jobs, health, auth and errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import API_KEY
from tests.waiting import ingest_finished

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
async def http(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        yield client


async def test_ask_returns_the_cli_json_shape_with_citations(http):
    r = await http.post("/v1/ask", json={"question": "What is the retry limit of the ingest service?"}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert {"answer", "sub_questions", "citations", "usage", "model"} <= body.keys()
    assert body["citations"] and {"page_id", "doc", "page", "score", "figure"} == body["citations"][0].keys()
    assert body["model"]["random_weights"] is True and "not meaningful" in body["model"]["note"]


async def test_warm_up_at_start_up_filled_the_serving_engine(api_server):
    services = api_server["app"].state.services
    assert services.warm_report is not None and len(services.warm_report.warmed) == 4


async def test_everything_but_health_and_metrics_needs_the_api_key(http):
    r = await http.post("/v1/ask", json={"question": "q"})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["fix"]
    wrong = await http.get("/v1/documents", headers={"X-API-Key": "nope"})
    assert wrong.status_code == 401
    assert (await http.get("/healthz")).status_code == 200
    assert (await http.get("/metrics")).status_code == 200


async def test_readyz_checks_engine_qdrant_and_redis(http):
    r = await http.get("/readyz")
    assert r.status_code == 200, r.text
    assert set(r.json()["checks"]) == {"engine", "qdrant", "redis"} and r.json()["ready"] is True
    assert all(c.keys() == {"ok", "detail"} for c in r.json()["checks"].values())  # no null `error` keys


async def test_documents_list_their_pages_with_ids_that_resolve_to_those_pages(http):
    docs = (await http.get("/v1/documents", headers=AUTH)).json()["documents"]
    assert {"operations_manual.pdf", "q3_quarterly_report.pdf"} <= {d["doc"] for d in docs}
    for d in docs:
        numbers = [p["page"] for p in d["pages"]]
        assert numbers == sorted(numbers) and len(numbers) == d["indexed_pages"], d
        for listed in d["pages"]:
            page = (await http.get(f"/v1/pages/{listed['page_id']}", headers=AUTH)).json()
            assert (page["id"], page["doc_id"], page["doc"], page["page"]) == (
                listed["page_id"], d["doc_id"], d["doc"], listed["page"])


async def test_a_citations_page_id_resolves_to_the_cited_page_and_its_image(http):
    answer = (await http.post("/v1/ask", json={"question": "What was the Q3 revenue of the Nordic division?"},
                              headers=AUTH)).json()
    cited = answer["citations"][0]
    page = (await http.get(f"/v1/pages/{cited['page_id']}", headers=AUTH)).json()
    assert (page["doc"], page["page"]) == (cited["doc"], cited["page"]) and page["image_key"]
    image = await http.get(f"/v1/pages/{cited['page_id']}/image", headers=AUTH)
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert image.content.startswith(b"\x89PNG")


@pytest.mark.parametrize("page_id", ["not-a-page", "00000000-0000-0000-0000-000000000000"])
async def test_an_unknown_page_is_a_404_that_says_where_page_ids_come_from(http, page_id):
    missing = await http.get(f"/v1/pages/{page_id}", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "unknown_page"
    assert "GET /v1/documents" in missing.json()["error"]["fix"]


@pytest.mark.parametrize(
    "body, status, kind",
    [
        ({"question": "   "}, 400, "bad_question"),
        ({"question": "x" * 10_000}, 400, "bad_question"),
        ({"question": "What was the revenue?", "docs": ["no_such.pdf"]}, 404, "unknown_document"),
        ({"not_a_question": 1}, 422, "invalid_request"),
    ],
)
async def test_bad_requests_get_json_errors_with_the_fix(http, body, status, kind):
    r = await http.post("/v1/ask", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["message"]


async def test_oversized_bodies_are_refused_before_reading(http):
    r = await http.post("/v1/ask", content=b'{"question": "' + b"x" * 100_000 + b'"}', headers={
        **AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and "MMRAG_MAX_REQUEST_BYTES" in r.json()["error"]["fix"]


async def test_ingest_jobs_add_documents_while_serving(http, api_server, sample_corpus):
    outside = await http.post("/v1/ingest", json={"paths": ["/etc"]}, headers=AUTH)
    assert outside.status_code == 403 and "MMRAG_INGEST_ROOT" in outside.json()["error"]["fix"]
    slide = sorted(sample_corpus.glob("*.png"))[0]
    shutil.copy(slide, api_server["root"] / "new_slide.png")
    (api_server["root"] / "broken.pdf").write_bytes(b"%PDF-1.7 broken")
    job = (await http.post("/v1/ingest", json={"paths": ["."]}, headers=AUTH)).json()
    status = await _wait_for_job(http, job["id"])
    assert status["status"] == "done", status
    assert status["report"]["pages"] == 1 and [f["path"] for f in status["report"]["failed"]][0].endswith("broken.pdf")
    docs = (await http.get("/v1/documents", headers=AUTH)).json()["documents"]
    assert "new_slide.png" in {d["doc"] for d in docs}
    assert (await http.get("/healthz")).status_code == 200  # still serving


async def test_links_found_while_walking_cannot_leave_the_ingest_root(http, api_server, sample_corpus, tmp_path):
    # Reproduces the probe: evil/ sits under MMRAG_INGEST_ROOT and holds a link to a file outside it.
    outside = tmp_path / "secret.png"
    shutil.copy(sorted(sample_corpus.glob("*.png"))[1], outside)
    evil = api_server["root"] / "evil"
    evil.mkdir()
    (evil / "link.png").symlink_to(outside)
    (evil / "dangling.png").symlink_to(tmp_path / "gone.png")
    (evil / "loop.png").symlink_to(evil / "loop.png")
    job = (await http.post("/v1/ingest", json={"paths": ["evil"]}, headers=AUTH)).json()
    status = await _wait_for_job(http, job["id"])
    assert status["status"] == "done" and status["report"]["pages"] == 0, status
    failed = {Path(f["path"]).name: f["error"] for f in status["report"]["failed"]}
    assert "outside the ingest root" in failed["link.png"]
    assert "broken symbolic link" in failed["dangling.png"] and "broken symbolic link" in failed["loop.png"]
    docs = (await http.get("/v1/documents", headers=AUTH)).json()["documents"]
    assert not {"link.png", "secret.png"} & {d["doc"] for d in docs}


async def test_job_ids_are_unique_and_the_bearer_scheme_is_case_insensitive(http):
    ids = {(await http.post("/v1/ingest", json={"paths": ["."]}, headers=AUTH)).json()["id"] for _ in range(2)}
    assert len(ids) == 2 and all(len(i) > len("job-1") for i in ids)  # not a counter that restarts at job-1
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = await http.get("/v1/documents", headers={"Authorization": f"{scheme} {API_KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    assert (await http.get("/v1/documents", headers={"Authorization": "Basic " + API_KEY})).status_code == 401
    for job_id in ids:
        await _wait_for_job(http, job_id)


async def _wait_for_job(http, job_id: str) -> dict:
    """The job once finished (60 s: a hang guard)."""
    return await ingest_finished(http, job_id, timeout=60, headers=AUTH)


async def test_openapi_docs_list_the_endpoints(http):
    spec = (await http.get("/openapi.json")).json()
    assert {"/v1/ask", "/v1/documents", "/v1/pages/{page_id}", "/v1/ingest", "/healthz", "/readyz"} <= set(spec["paths"])


async def test_a_dead_engine_gives_503_with_the_fix_and_readyz_says_not_ready(engine_settings, ingested, tmp_path):
    from mmrag.wiring import resolve_model
    from mmrag.wiring import feature_store
    from mmrag.wiring import create_app
    from serving.engine.features import FeatureProvider
    from serving.engine.remote import RemoteEngine

    from tests.conftest import copy_corpus

    copy_corpus(engine_settings, tmp_path)  # index and image tokens: only the engine is missing
    settings = engine_settings.replace(**{"data_dir": tmp_path, "warm_top": 0})
    dead = RemoteEngine(["http://127.0.0.1:9"], resolve_model(settings),
                        FeatureProvider.unscoped(feature_store(engine_settings)))
    app = create_app(settings, engine=dead)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            r = await client.post("/v1/ask", json={"question": "What is the retry limit of the ingest service?"})
            ready = await client.get("/readyz")
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
    assert "mmrag engine serve" in r.json()["error"]["message"]
    assert ready.status_code == 503 and ready.json()["checks"]["engine"]["ok"] is False
    assert ready.json()["checks"]["engine"].keys() == {"ok", "error"}


# --- no route shows a server path, in a 200's body as in an error's ---------------------------------------


def _server_folders(api_server, engine_settings, tiny_model: Path, sample_corpus: Path, session_tmp: Path) -> set[str]:
    """The server's absolute folders, each as given and resolved: the data dirs, the ingest root, the model, the
    folder the corpus was ingested from, and the test session's temp root that holds them all."""
    folders = [api_server["settings"].storage.data_dir, api_server["root"], engine_settings.storage.data_dir,
               tiny_model,
               sample_corpus, session_tmp]
    return {str(p) for p in folders} | {str(p.resolve()) for p in folders}


async def test_no_route_shows_a_server_path_in_any_body(http, api_server, engine_settings, tiny_model,
                                                        sample_corpus, tmp_path_factory):
    from tests.test_ask_images import new_figure  # a PNG no other test has ingested

    app, root = api_server["app"], api_server["root"]
    folder = root / "paths-shown"
    folder.mkdir()
    shutil.copy(sorted(sample_corpus.glob("*.png"))[2], folder / "slide.png")
    called: dict[tuple[str, str], list[httpx.Response]] = {}

    async def call(method: str, template: str, url: str | None = None, **kwargs) -> httpx.Response:
        r = await http.request(method, url or template, headers={**AUTH, **kwargs.pop("headers", {})}, **kwargs)
        called.setdefault((method, template), []).append(r)
        return r

    ingest = (await call("POST", "/v1/ingest", json={"paths": ["paths-shown"]})).json()
    await call("GET", "/v1/ingest/{job_id}", f"/v1/ingest/{ingest['id']}")
    assert (await _wait_for_job(http, ingest["id"]))["report"]["pages"] == 1
    upload = (await call("POST", "/v1/documents", files={"file": ("figure.png", new_figure(), "image/png")})).json()
    assert (await _wait_for_job(http, upload["job"]["id"]))["status"] == "done"
    await call("POST", "/v1/ingest/{job_id}/cancel", f"/v1/ingest/{upload['job']['id']}/cancel")
    await call("GET", "/v1/ingest")

    docs = (await call("GET", "/v1/documents", "/v1/documents?limit=1000")).json()["documents"]
    shown = {d["doc"]: d["path"] for d in docs}
    assert shown["slide.png"] == "paths-shown/slide.png"  # relative to the ingest root
    assert shown[upload["doc"]] == upload["doc"]  # an upload: its file name
    assert shown["operations_manual.pdf"] == "operations_manual.pdf"  # ingested from outside the root: its name
    for d in docs:
        page = (await call("GET", "/v1/pages/{page_id}", f"/v1/pages/{d['pages'][0]['page_id']}")).json()
        assert page["path"] == d["path"], page
    slide = next(d for d in docs if d["doc"] == "slide.png")["pages"][0]["page_id"]
    await call("GET", "/v1/pages/{page_id}/image", f"/v1/pages/{slide}/image")
    await call("DELETE", "/v1/documents/{doc_id}", f"/v1/documents/{upload['doc_id']}")

    await call("POST", "/v1/ask", json={"question": "What is the retry limit of the ingest service?"})
    await call("POST", "/v1/ask", json={"question": "What is the retry limit?", "stream": True})
    await call("POST", "/v1/ask/upload", data={"question": "What does this figure show?"},
               files={"images": ("figure.png", new_figure(), "image/png")})
    await call("GET", "/v1/models")
    await call("POST", "/v1/chat/completions", json={"model": "mmrag", "messages": [
        {"role": "user", "content": "How long are backups retained?"}]})
    for public in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
                   "/ui"):
        await call("GET", public)
    for asset in ("index.html", "app.js", "api.js", "app.css"):
        await call("GET", "/ui/{name}", f"/ui/{asset}")
    # And errors, some of which name files: outside the root, a NUL byte, a missing page, a file gone.
    await call("POST", "/v1/ingest", json={"paths": ["/etc"]})
    await call("POST", "/v1/ingest", json={"paths": ["../.."]})
    await call("POST", "/v1/ingest", json={"paths": ["a\u0000b"]})
    await call("GET", "/v1/pages/{page_id}", "/v1/pages/00000000-0000-0000-0000-000000000000")
    (folder / "slide.png").unlink()
    gone = await call("GET", "/v1/pages/{page_id}/image", f"/v1/pages/{slide}/image")
    assert gone.status_code == 410 and "slide.png" in gone.json()["error"]["message"]

    routes = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"}
    assert routes - set(called) == set(), "a route this test does not call: add it"
    folders = _server_folders(api_server, engine_settings, tiny_model, sample_corpus, tmp_path_factory.getbasetemp())
    for (method, template), responses in called.items():
        for r in responses:
            assert r.status_code < 500, (method, template, r.text)
            for path in folders:
                assert path.encode() not in r.content, f"{method} {r.url.path} ({r.status_code}) shows {path}"
