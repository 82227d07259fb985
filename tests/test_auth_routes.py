"""Route auth, enumerated from the app: every route but an explicit public list refuses a request without the
API key or with a wrong one (401 in the service's error shape), called on the real server; and every other route
is an APIRoute with `require_api_key` in its dependency tree. A new route that forgets the key fails both."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import httpx
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Mount

from serving.api.deps import require_api_key
from tests.conftest import API_KEY

# Probes and scrapers carry no key (liveness, readiness, Prometheus), and the API's own documentation is public; so
# is the page (/ui: static files holding no data, which ask for the key and send it to the routes above).
PUBLIC = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/ui",
          "/ui/{name}"}
NO_KEY = {"none": {}, "wrong bearer": {"Authorization": "Bearer not-the-key"}, "wrong X-API-Key": {"X-API-Key": "nope"},
          "right key, wrong scheme": {"Authorization": f"Basic {API_KEY}"}}
DUMMY_PARAMS = ["1", "00000000-0000-0000-0000-000000000000"]  # the first that a path parameter's convertor takes


def _calls(route: BaseRoute) -> Iterator[tuple[str, str]]:
    """(method, URL) for each way into the route, path parameters filled in; a mount is entered below its path."""
    params = {name: next(v for v in DUMMY_PARAMS if re.fullmatch(conv.regex, v))
              for name, conv in route.param_convertors.items()}
    url = route.path_format.format(**params)
    if isinstance(route, Mount):
        yield "GET", f"{url}/x"
    else:
        for method in sorted(route.methods):
            yield method, url


async def _statuses_without_the_key(client: httpx.AsyncClient, routes: list[BaseRoute]) -> dict[str, int]:
    """What each route answers without the right key, wherever that is not a 401 in the error shape naming Bearer."""
    wrong = {}
    for route in routes:
        for method, url in _calls(route):
            for how, headers in NO_KEY.items():
                r = await client.request(method, url, headers=headers)
                shaped = method == "HEAD" or _error_type(r) == "unauthorized"
                if r.status_code != 401 or not shaped or r.headers.get("www-authenticate") != "Bearer":
                    wrong[f"{method} {url} ({how})"] = r.status_code
    return wrong


def _error_type(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


def _dependency_calls(dependant: Dependant) -> Iterator[Callable]:
    for dep in dependant.dependencies:
        yield dep.call
        yield from _dependency_calls(dep)


def _without_the_key_dependency(routes: list[BaseRoute]) -> list[str]:
    return [route.path for route in routes
            if not isinstance(route, APIRoute) or require_api_key not in _dependency_calls(route.dependant)]


def _private(app: FastAPI) -> list[BaseRoute]:
    return [r for r in app.routes if r.path not in PUBLIC]


async def test_every_route_but_the_public_ones_refuses_a_missing_or_wrong_key(api_server):
    app = api_server["app"]
    assert PUBLIC <= {r.path for r in app.routes}, "a public route in the list is gone: update PUBLIC"
    private = _private(app)
    assert len(private) >= 6, [r.path for r in private]  # ask, documents, two page routes, two ingest routes
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        assert await _statuses_without_the_key(client, private) == {}
        public = [r for r in app.routes if r.path in PUBLIC]
        refused = {url for r in public for method, url in _calls(r)
                   if (await client.request(method, url)).status_code == 401}
    assert refused == set(), "a route in PUBLIC needs the key: take it off the list"


def test_every_route_but_the_public_ones_depends_on_require_api_key(api_server):
    # A plain Starlette route or a mount cannot carry the dependency: it must be public or become an APIRoute.
    assert _without_the_key_dependency(_private(api_server["app"])) == []


async def test_a_route_that_forgets_the_key_is_caught_by_both():
    from mmrag.core.settings import Settings
    from mmrag.wiring import create_app

    app = create_app(Settings(api_key=API_KEY))  # not started: the forgotten route needs no services

    @app.get("/v1/forgot")
    async def forgot() -> dict:
        return {}

    assert _without_the_key_dependency(_private(app)) == ["/v1/forgot"]
    forgotten = [r for r in app.routes if r.path == "/v1/forgot"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        assert await _statuses_without_the_key(client, forgotten) == {
            f"GET /v1/forgot ({how})": 200 for how in NO_KEY}
