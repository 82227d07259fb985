"""Hostile inputs against the real server (uvicorn on 127.0.0.1): each gets a 4xx in the service's error shape
(or a failed file in its ingest job), never a 500, and the keep-alive connection survives it.

Also: /metrics and error bodies never show absolute server paths (data dir, model dir, ingest root).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest

from mmrag.adapters.store import DiskFeatureStore, FeatureStoreError
from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy
from mmrag.core.pages import EncodedImage
from mmrag.core.settings import Settings
from serving.http import errors
from serving.metrics import Metrics
from tests.conftest import API_KEY, free_port
from tests.test_api import _wait_for_job
from tests.waiting import eventually

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**AUTH, "content-type": "application/json"}


@pytest.fixture
async def http(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        yield client


def _client_port(r: httpx.Response) -> int | None:
    """The client-side port of the connection ``r`` came on; None once that connection is closed."""
    try:
        return r.extensions["network_stream"].get_extra_info("client_addr")[1]
    except OSError:  # its socket is closed
        return None


async def _error_then_still_served(http, r: httpx.Response, status: int, kind: str) -> dict:
    """The service's error shape, and the same keep-alive connection answers the next request."""
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"type", "message", "fix"}, r.text
    assert r.json()["error"]["type"] == kind, r.text
    assert r.headers.get("connection", "keep-alive") != "close"
    again = await http.get("/healthz")
    assert again.status_code == 200
    assert _client_port(r) is not None and _client_port(again) == _client_port(r), \
        "the server dropped the keep-alive connection"
    return r.json()["error"]


# --- text that is not Unicode, NUL bytes, symlink loops ----------------------------------------------------


@pytest.mark.parametrize("route, body", [
    ("/v1/ask", rb'{"question": "\ud800 What is the retry limit?"}'),
    ("/v1/ask", rb'{"question": "What is the retry limit?", "docs": ["\udfff.pdf"]}'),
    ("/v1/ask", rb'{"question": "What is the retry limit?", "\ud800": 1}'),
    ("/v1/ingest", rb'{"paths": ["\ud800"]}'),
    ("/v1/ingest", rb'{"paths": ["\udcff.pdf"]}'),  # would become the raw byte 0xff through surrogateescape
])
async def test_a_lone_surrogate_in_any_text_field_is_a_400(http, route, body):
    r = await http.post(route, content=body, headers=JSON)
    err = await _error_then_still_served(http, r, 400, "invalid_text")
    assert "surrogate" in err["message"] and err["fix"]


async def test_a_body_that_is_not_utf8_is_a_400(http):
    r = await http.post("/v1/ask", content=b'{"question": "caf\xe9?"}', headers=JSON)  # Latin-1, not UTF-8
    err = await _error_then_still_served(http, r, 400, "invalid_text")
    assert "UTF-8" in err["message"]


async def test_a_surrogate_pair_is_an_ordinary_character(http):
    r = await http.post("/v1/ask", content=rb'{"question": "\ud83d\ude00"}', headers=JSON)
    assert r.status_code == 200, r.text  # one emoji, written as its JSON escape pair


async def test_a_nul_byte_in_an_ingest_path_is_a_400(http):
    r = await http.post("/v1/ingest", json={"paths": ["a\u0000b"]}, headers=AUTH)
    err = await _error_then_still_served(http, r, 400, "invalid_path")
    assert "NUL" in err["message"]


async def test_an_ingest_path_that_is_a_symlink_loop_is_a_400(http, api_server):
    folder = api_server["root"] / "hostile-loop"
    folder.mkdir()
    (folder / "loop").symlink_to("loop")
    r = await http.post("/v1/ingest", json={"paths": ["hostile-loop/loop"]}, headers=AUTH)
    err = await _error_then_still_served(http, r, 400, "invalid_path")
    assert "symbolic link loop" in err["message"]
    assert str(api_server["root"]) not in r.text


# --- bodies too large or too deep, unknown routes -------------------------------------------------------


async def _ten_mb_chunked():
    yield b'{"question": "'
    for _ in range(160):
        yield b"x" * 65_536


@pytest.mark.parametrize("chunked", [True, False])
async def test_a_body_over_the_limit_is_a_413_in_the_error_shape(http, chunked):
    content = _ten_mb_chunked() if chunked else b'{"question": "' + b"x" * 100_000 + b'"}'
    r = await http.post("/v1/ask", content=content, headers=JSON)
    # Chunked: no Content-Length, so the limit is counted as the body arrives, inside FastAPI's body read.
    assert ("content-length" not in r.request.headers) is chunked
    err = await _error_then_still_served(http, r, 413, "request_too_large")
    assert "MMRAG_MAX_REQUEST_BYTES" in err["fix"]


@pytest.mark.parametrize("body", [b"[" * 10_000 + b"]" * 10_000, b'{"a":' * 10_000 + b"1" + b"}" * 10_000])
async def test_json_nested_10_000_deep_is_a_400_in_the_error_shape(http, body):
    r = await http.post("/v1/ask", content=body, headers=JSON)
    err = await _error_then_still_served(http, r, 400, "invalid_json")
    assert "nested" in err["message"]


@pytest.mark.parametrize("method, url, status, kind", [
    ("GET", "/no/such/route", 404, "not_found"),
    ("DELETE", "/v1/ask", 405, "method_not_allowed"),
    ("POST", "/healthz", 405, "method_not_allowed"),
])
async def test_unknown_routes_and_methods_answer_in_the_error_shape(http, method, url, status, kind):
    r = await http.request(method, url, headers=AUTH)
    err = await _error_then_still_served(http, r, status, kind)
    assert err["fix"]
    if status == 405:
        assert r.headers["allow"]


async def test_a_body_that_is_not_json_is_a_422_in_the_error_shape(http):
    r = await http.post("/v1/ask", content=b"{not json", headers=JSON)
    await _error_then_still_served(http, r, 422, "invalid_request")


async def test_a_bug_is_a_500_in_the_error_shape_and_keeps_the_connection(tmp_path):
    # No route of the service is known to fail so: a bare app with the service's error handling, on uvicorn.
    app = FastAPI()
    errors.install(app, errors.ServerPaths.of(Settings(data_dir=tmp_path).folders))

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError(f"an unforeseen failure reading {tmp_path / 'x'}")

    @app.get("/healthz")
    async def healthz() -> dict:
        return {}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="critical"))
    task = asyncio.get_running_loop().create_task(server.serve())

    def started() -> bool:
        if task.done():
            pytest.fail(f"uvicorn ended before it started: {task.exception()!r}")
        return server.started

    await eventually(started, timeout=60, what="uvicorn started")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.config.port}") as client:
            r = await client.get("/bug")
            err = await _error_then_still_served(client, r, 500, "internal")
    finally:
        server.should_exit = True
        await task
    assert "RuntimeError" in err["message"] and str(tmp_path) not in err["message"]


# --- over-long names: that one file fails, the rest ingest ----------------------------------------------


def _deep_file(top: Path, src: Path) -> None:
    """A file at a path over PATH_MAX (4096 bytes) under ``top``: made relative to open folders, as only that can."""
    fd = os.open(top, os.O_RDONLY)
    try:
        for _ in range(20):
            os.mkdir("d" * 250, dir_fd=fd)
            child = os.open("d" * 250, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        out = os.open("deep.png", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
        with open(out, "wb") as f:
            f.write(src.read_bytes())
    finally:
        os.close(fd)


async def test_an_over_long_name_fails_that_file_alone(http, api_server, sample_corpus):
    slides = sorted(sample_corpus.glob("*.png"))
    folder = api_server["root"] / "hostile-long"
    folder.mkdir()
    shutil.copy(slides[2], folder / "normal.png")
    longest = "n" * (255 - len(".png")) + ".png"  # NAME_MAX exactly: a legal name, it must ingest
    shutil.copy(slides[3], folder / longest)
    _deep_file(folder, slides[4])  # found while walking, but its path is over PATH_MAX
    too_long = "hostile-long/" + "z" * 300 + ".png"  # over NAME_MAX: no file can have this name

    job = (await http.post("/v1/ingest", json={"paths": ["hostile-long", too_long], "recursive": True},
                           headers=AUTH)).json()
    status = await _wait_for_job(http, job["id"])

    assert status["status"] == "done", status
    assert status["report"]["pages"] == 2, status  # normal.png and the 255-byte name
    failed = {f["path"]: f["error"] for f in status["report"]["failed"]}
    assert len(failed) == 2, failed
    assert "too long" in failed[too_long]
    deep = next(p for p in failed if p != too_long)
    assert deep.startswith("hostile-long/") and "too long" in failed[deep]
    docs = {d["doc"] for d in (await http.get("/v1/documents", headers=AUTH)).json()["documents"]}
    assert {"normal.png", longest} <= docs
    assert str(api_server["root"]) not in str(status)


async def test_a_file_name_that_is_not_utf8_fails_that_file_alone(http, api_server, sample_corpus):
    folder = api_server["root"] / "hostile-bytes"
    folder.mkdir()
    shutil.copy(sorted(sample_corpus.glob("*.png"))[5], folder / "fine.png")
    shutil.copy(sorted(sample_corpus.glob("*.png"))[5], os.fsencode(folder) + b"/bad\xff.png")
    job = (await http.post("/v1/ingest", json={"paths": ["hostile-bytes"]}, headers=AUTH)).json()
    status = await _wait_for_job(http, job["id"])
    assert status["status"] == "done" and status["report"]["pages"] == 1, status
    [failure] = status["report"]["failed"]
    assert "UTF-8" in failure["error"] and failure["path"] == "hostile-bytes/bad\ufffd.png"


# --- no absolute server paths: /metrics and error bodies ------------------------------------------------


def _server_paths(api_server, tiny_model: Path, engine_settings) -> list[str]:
    paths = {api_server["settings"].storage.data_dir, api_server["root"], tiny_model, engine_settings.storage.data_dir}
    return sorted({str(p) for p in paths} | {str(p.resolve()) for p in paths})


async def test_metrics_show_the_model_name_not_its_folder(http, api_server, tiny_model, engine_settings):
    r = await http.post("/v1/ask", json={"question": "What is the retry limit of the ingest service?"}, headers=AUTH)
    assert r.status_code == 200, r.text
    text = (await http.get("/metrics")).text
    assert "vllm:" in text
    for path in _server_paths(api_server, tiny_model, engine_settings):
        assert path not in text, f"/metrics shows {path}"
    assert f'model_name="{tiny_model.name}"' in text


class _ReplicaStartedOnAFolder(BaseHTTPRequestHandler):
    """A `vllm serve /srv/models/Qwen2-VL-2B` replica without --served-model-name: its labels name the folder."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        body = (b"# TYPE vllm:kv_cache_usage_perc gauge\n"
                b'vllm:kv_cache_usage_perc{engine="0",model_name="/srv/models/Qwen2-VL-2B"} 0.5\n')
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_metrics_of_remote_replicas_show_the_model_name_not_its_folder():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ReplicaStartedOnAFolder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    try:
        metrics.register_remote_replicas([f"http://127.0.0.1:{server.server_address[1]}"], timeout_s=5)
        text = generate_latest(registry).decode()
    finally:
        metrics.unregister()
        server.shutdown()
        server.server_close()
    assert 'model_name="Qwen2-VL-2B"' in text and "/srv/models" not in text


async def test_error_bodies_never_show_absolute_server_paths(http, api_server, sample_corpus, tiny_model,
                                                             engine_settings):
    root = api_server["root"]
    folder = root / "hostile-paths"
    folder.mkdir()
    shutil.copy(sorted(sample_corpus.glob("*.png"))[4], folder / "soon_gone.png")
    (folder / "broken.pdf").write_bytes(b"%PDF-1.7 broken")
    job = (await http.post("/v1/ingest", json={"paths": ["hostile-paths"]}, headers=AUTH)).json()
    status = await _wait_for_job(http, job["id"])
    assert status["report"]["pages"] == 1, status
    assert status["paths"] == ["hostile-paths"] and status["report"]["failed"][0]["path"] == "hostile-paths/broken.pdf"
    docs = (await http.get("/v1/documents", headers=AUTH)).json()["documents"]
    page_id = next(d for d in docs if d["doc"] == "soon_gone.png")["pages"][0]["page_id"]
    (folder / "soon_gone.png").unlink()

    bodies = [
        status,
        await http.post("/v1/ingest", json={"paths": ["/etc"]}, headers=AUTH),  # outside the root
        await http.post("/v1/ingest", json={"paths": ["../.."]}, headers=AUTH),
        await http.get(f"/v1/pages/{page_id}/image", headers=AUTH),  # source gone: 410
        await http.post("/v1/ingest", json={"paths": ["a\u0000b"]}, headers=AUTH),
    ]
    statuses = [b.status_code for b in bodies[1:]]
    assert statuses == [403, 403, 410, 400], statuses
    for body in bodies:
        text = str(body) if isinstance(body, dict) else body.text
        for path in _server_paths(api_server, tiny_model, engine_settings):
            assert path not in text, f"{text} shows {path}"
    assert "soon_gone.png" in bodies[3].json()["error"]["message"]


async def test_a_feature_store_error_names_the_data_dir_setting_not_its_folder(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", ingest_root=tmp_path / "in")
    store = DiskFeatureStore(settings.storage.features_dir)
    key = ImageKey(ContentHash(hashlib.sha256(b"page").hexdigest()), EncoderVersion("ab" * 8),
                   ResolutionPolicy(56 * 56, 448 * 448))
    (settings.storage.features_dir / key.content_hash[:2]).write_text("a file where the store wants its shard folder")
    with pytest.raises(FeatureStoreError) as failed:
        store.put(key, EncodedImage(torch.zeros(4, 8), torch.tensor([[1, 4, 4]])))
    assert str(settings.storage.features_dir) in str(failed.value)  # the store names its folder, for the server's log

    app = FastAPI()
    errors.install(app, errors.ServerPaths.of(settings.folders))

    @app.get("/store")
    async def fail() -> None:
        raise failed.value

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        r = await client.get("/store")
    assert r.status_code == 503 and r.json()["error"]["type"] == "feature_store_unavailable", r.text
    assert str(tmp_path) not in r.text and "$MMRAG_DATA_DIR/features" in r.json()["error"]["message"]
