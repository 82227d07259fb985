"""`mmrag engine serve`: one `vllm serve` replica of the configured model, in the foreground.

Registered in mmrag/cli.py as ``app.add_typer(engine_app, name="engine")``.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from typing import Annotated

import typer
from rich.console import Console

engine_app = typer.Typer(no_args_is_help=True)

err = Console(stderr=True)


@engine_app.callback()
def engine() -> None:
    """Run vLLM replicas for the remote engine (list their URLs in MMRAG_ENGINE_URLS)."""
    # A callback keeps `serve` a subcommand even while it is the group's only command.


@engine_app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8100,
    ready_timeout: Annotated[float, typer.Option(help="Seconds to wait for the server to answer /health.")] = 600.0,
    kv_events_port: Annotated[int, typer.Option(
        help="Publish the replica's KV events on this TCP port (every interface; replay on the next port), so "
             "routers send each prompt where its pages' KV is (MMRAG_KV_EVENTS_ENDPOINTS, printed at start). The "
             "events carry token ids: keep the port on a private network. 0: none.")] = 0,
) -> None:
    """Serve the configured model with `vllm serve` (prefix caching and image embeddings on) until Ctrl-C.

    Uses the same engine settings (MMRAG_KV_BLOCK_SIZE, MMRAG_KV_CACHE_GIB, ...) as the in-process engine.
    """
    from mmrag.core.settings import Settings
    from mmrag import wiring
    from serving.vllm_launch import ServerHandle, ServerStartError, start_server

    settings = Settings()
    model = wiring.resolve_model(settings)
    config = wiring.engine_config(settings)
    if kv_events_port:
        config = dataclasses.replace(config, kv_events=f"tcp://*:{kv_events_port}")
    err.print(f"model: {model.describe()}")
    err.print(f"starting vllm serve on {host}:{port} (30-40 s on CPU with the tiny model) ...")
    handle: ServerHandle | None = None
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        # The server runs in its own session; hand it the signal so it shuts its engine core down cleanly.
        nonlocal stopping
        stopping = True
        if handle is not None and handle.proc.poll() is None:
            handle.proc.send_signal(signum)

    signal.signal(signal.SIGINT, forward)  # installed first: no window in which Ctrl-C orphans the server
    signal.signal(signal.SIGTERM, forward)
    handle = start_server(model.path, config, host=host, port=port, log_path=None)
    if stopping:
        handle.proc.send_signal(signal.SIGINT)
    try:
        seconds = handle.wait_ready(ready_timeout)
    except ServerStartError as exc:
        if not stopping:
            handle.stop()
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(1) from None
    else:
        if not stopping:  # after a stop signal during start-up the server is going down: do not announce it
            err.print(f"[green]ready[/] in {seconds:.0f} s at [bold]{handle.url}[/]")
            typer.echo(f"MMRAG_ENGINE_URLS={handle.url}")  # stdout: the lines a script or another shell needs
            if kv_events_port:
                typer.echo(f"MMRAG_KV_EVENTS_ENDPOINTS=tcp://{host}:{kv_events_port}")
            sys.stdout.flush()
    code = handle.proc.wait()
    raise typer.Exit(0 if stopping and code in (0, -signal.SIGINT, -signal.SIGTERM) else code)
