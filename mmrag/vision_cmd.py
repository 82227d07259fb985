"""`mmrag vision serve`: the vision feature service (serving/vision/), in the foreground.

Registered in mmrag/cli.py as ``app.add_typer(vision_app, name="vision")``.
"""

from __future__ import annotations

from typing import Annotated

import typer

vision_app = typer.Typer(no_args_is_help=True)


@vision_app.callback()
def vision() -> None:
    """Run the vision tower + projector as a service of its own (point MMRAG_VISION_URL at it)."""
    # A callback keeps `serve` a subcommand while it is the group's only command.


@vision_app.command("serve")
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on (MMRAG_HOST).")] = None,
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8200,
) -> None:
    """Serve the vision tower of the configured model until Ctrl-C: POST /v1/encode, GET /v1/info, /metrics.

    The tower runs on MMRAG_VISION_DEVICE in MMRAG_VISION_DTYPE; tokens go to the feature store (MMRAG_REDIS_URL, else MMRAG_DATA_DIR).

    Concurrent callers share forwards: up to MMRAG_VISION_MAX_BATCH images, after MMRAG_VISION_MAX_WAIT_MS.

    Beyond MMRAG_VISION_QUEUE_CAP queued images callers get 429 with Retry-After.

    Then set MMRAG_VISION_URL=http://HOST:PORT for `mmrag ingest` and `mmrag serve`.
    """
    import uvicorn

    from core.settings import Settings
    from mmrag.wiring import vision_app as build

    settings = Settings()
    uvicorn.run(build(settings), host=host or settings.host, port=port, log_level="info")
