"""GET /ui: a page to look at mmrag with (ask, see the cited pages with their figures outlined and the cache at
work, manage documents). Plain static files shipped in the package (serving/api/ui/), no build step and nothing
fetched from elsewhere: the page works offline.

The files need no key: they hold no data. The page asks for the key, keeps it in the browser session only, and
sends it to the API routes as every client does (``Authorization: Bearer``). Not in /openapi.json: a page, not
an API.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

from serving.http.errors import ApiError

router = APIRouter(include_in_schema=False)

UI_PATH = "/ui"
# The page's files and their types: a fixed list, so no client path ever reaches the file system.
ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "api.js": "text/javascript; charset=utf-8",
          "app.css": "text/css; charset=utf-8"}
# Only this server is reached: scripts, styles and fetches from it, images from it or made by the page (blob:,
# a cited page fetched with the key). A CDN reference would be refused by the browser, not just avoided here.
CSP = ("default-src 'self'; img-src 'self' blob: data:; connect-src 'self'; script-src 'self'; style-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache",
           "Referrer-Policy": "no-referrer"}


def _asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise ApiError(404, "not_found", f"the page has no file {name!r}",
                       f"open {UI_PATH}; its files are {', '.join(sorted(ASSETS))}")
    body = files("serving.api").joinpath("ui", name).read_bytes()
    return Response(body, media_type=media_type, headers=HEADERS)


@router.get(UI_PATH)
async def page() -> Response:
    return _asset("index.html")


@router.get(UI_PATH + "/{name}")
async def asset(name: str) -> Response:
    return _asset(name)
