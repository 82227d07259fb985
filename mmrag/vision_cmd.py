"""`mmrag vision serve`: the vision feature service (serving/vision/), in the foreground.

Registered in mmrag/cli.py as ``app.add_typer(vision_app, name="vision")``.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Annotated

import typer

log = logging.getLogger(__name__)

vision_app = typer.Typer(no_args_is_help=True)


@vision_app.callback()
def vision() -> None:
    """Run the vision tower + projector as a service of its own (point MMRAG_VISION_URL at it)."""
    # A callback keeps `serve` a subcommand while it is the group's only command.


@vision_app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on. 127.0.0.1 (this host only) unless given; "
                                           "to serve other hosts (0.0.0.0), set MMRAG_VISION_API_KEY too.")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8200,
) -> None:
    """Serve the vision tower of the configured model until Ctrl-C: POST /v1/encode, GET /v1/info, /metrics.

    The tower runs on MMRAG_VISION_DEVICE in MMRAG_VISION_DTYPE; tokens go to the feature store (MMRAG_REDIS_URL, else MMRAG_DATA_DIR).

    Concurrent callers share forwards: up to MMRAG_VISION_MAX_BATCH images, after MMRAG_VISION_MAX_WAIT_MS.

    Beyond MMRAG_VISION_QUEUE_CAP queued images callers get 429 with Retry-After.

    Decoded pixels: a request's images may declare at most MMRAG_MAX_REQUEST_PIXELS (else 413), all requests' at most MMRAG_MAX_PIXELS_IN_FLIGHT at once (else 429 with Retry-After).

    It listens on 127.0.0.1 unless --host says otherwise. With MMRAG_VISION_API_KEY every route but /healthz, /readyz and /metrics asks for `Authorization: Bearer <key>`.

    Then set MMRAG_VISION_URL=http://HOST:PORT (and the same MMRAG_VISION_API_KEY) for `mmrag ingest` and `mmrag serve`.
    """
    import uvicorn

    from mmrag.core.settings import Settings
    from mmrag.wiring import vision_app as build

    settings = Settings()
    if not settings.vision.api_key and not loopback(host):
        log.warning("the vision service listens on %s without MMRAG_VISION_API_KEY: anyone who reaches the port "
                    "can make it decode and encode images; set MMRAG_VISION_API_KEY (and the same on its clients)",
                    host)
    uvicorn.run(build(settings), host=host, port=port, log_level="info")


def loopback(host: str) -> bool:
    """``host`` is this machine's loopback (127.0.0.1, ::1, localhost): only local processes reach a port on it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
