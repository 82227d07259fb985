"""The vision service's key (issue 24): with MMRAG_VISION_API_KEY every route but /healthz, /readyz and /metrics
answers 401 in the error shape, naming the setting, to a request without `Authorization: Bearer <key>`, before
its body is read; the client (mmrag/adapters/vision_client.py) sends the key; `mmrag vision serve` listens on
127.0.0.1 unless --host says otherwise. The guarded service is the real app on a real port, in this process."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from mmrag.adapters.vision_client import RemoteVisionEncoder, VisionServiceError, service_info
from mmrag import wiring
from serving.vision.app import PUBLIC_PATHS
from tests.conftest import serving
from tests.test_vision_service import local_settings, new_images

KEY = "vision-key-for-tests"
NOT_THE_KEY = {"none": {}, "wrong bearer": {"Authorization": "Bearer not-the-key"},
               "right key, wrong scheme": {"Authorization": f"Basic {KEY}"},
               "the key with a suffix": {"Authorization": f"Bearer {KEY}x"}}


@pytest.fixture(scope="module")
async def guarded(tiny_model, tmp_path_factory):
    settings = local_settings(tiny_model, tmp_path_factory.mktemp("guarded-vision"), vision_api_key=KEY)
    app = wiring.vision_app(settings)
    async with serving(app) as url:
        yield {"url": url, "app": app, "settings": settings}


async def test_every_route_but_the_probes_and_metrics_refuses_a_missing_or_wrong_key_with_401(guarded):
    routes = [(method, route.path) for route in guarded["app"].routes for method in sorted(route.methods)
              if route.path not in PUBLIC_PATHS]
    assert ("POST", "/v1/encode") in routes and ("GET", "/v1/info") in routes and ("GET", "/openapi.json") in routes
    wrong = {}
    async with httpx.AsyncClient(base_url=guarded["url"]) as client:
        for method, path in routes:
            for how, headers in NOT_THE_KEY.items():
                r = await client.request(method, path, headers=headers)
                shaped = method == "HEAD" or _names_the_setting(r)  # a HEAD answer has no body
                if r.status_code != 401 or r.headers.get("www-authenticate") != "Bearer" or not shaped:
                    wrong[f"{method} {path} ({how})"] = (r.status_code, r.text[:200])
        for path in sorted(PUBLIC_PATHS):  # probes and Prometheus carry no key
            assert (await client.get(path)).status_code == 200, path
    assert not wrong


def _names_the_setting(r: httpx.Response) -> bool:
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return error["type"] == "unauthorized" and "MMRAG_VISION_API_KEY" in error["fix"]


async def test_the_key_is_checked_before_the_body_is_read(guarded):
    # A body that is not multipart: read, it would be a 4xx of its own; the 401 comes first.
    async with httpx.AsyncClient(base_url=guarded["url"]) as client:
        r = await client.post("/v1/encode", content=b"x" * 100_000,
                              headers={"Content-Type": "multipart/form-data; boundary=nothing"})
    assert r.status_code == 401, r.text


async def test_the_right_key_is_served_and_the_client_sends_it_end_to_end(guarded):
    url, (image,) = guarded["url"], new_images([(90, 120)])
    async with httpx.AsyncClient(base_url=url) as client:
        for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive (RFC 9110)
            assert (await client.get("/v1/info", headers={"Authorization": f"{scheme} {KEY}"})).status_code == 200

    def through_the_client() -> tuple[int, int, str]:
        client = RemoteVisionEncoder(url, api_key=guarded["settings"].vision.api_key)
        try:
            (encoded,) = client.view().encode([image])  # a view keeps the key
            return encoded.num_tokens, client.num_tokens_for(image), service_info(url, api_key=KEY).version
        finally:
            client.close()

    tokens, counted, version = await asyncio.to_thread(through_the_client)
    assert tokens == counted > 0 and version


async def test_a_client_without_the_key_is_told_which_setting_to_set(guarded):
    with pytest.raises(VisionServiceError) as refused:
        await asyncio.to_thread(RemoteVisionEncoder, guarded["url"])
    assert "HTTP 401" in str(refused.value) and "MMRAG_VISION_API_KEY" in str(refused.value)


def test_mmrag_vision_serve_listens_on_loopback_unless_told_otherwise(vision_server):
    from mmrag.cli import app
    from mmrag.vision_cmd import serve

    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"  # not MMRAG_HOST (the REST API's)
    help_text = " ".join(CliRunner().invoke(app, ["vision", "serve", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "127.0.0.1 (this host only) unless given" in help_text and "MMRAG_VISION_API_KEY" in help_text
    # The session's service was started without --host: its port listens on 127.0.0.1 alone.
    port = int(vision_server["url"].rsplit(":", 1)[1])
    assert _listening(port) == {"127.0.0.1"}


def _listening(port: int) -> set[str]:
    """Addresses listening on TCP ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))) if table == "tcp"
                          else f"[{address}]")
    return found
