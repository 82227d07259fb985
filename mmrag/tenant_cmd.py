"""`mmrag tenant add|list|quota|remove`: the API keys of each tenant, its share and bounds, in MMRAG_TENANTS_FILE (serving/api/tenants.py).

Registered in mmrag/cli.py as ``app.add_typer(tenant_app, name="tenant")``.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

tenant_app = typer.Typer(help="Tenants and their API keys (MMRAG_TENANTS_FILE): each tenant has its own "
                         "collection and sees, searches, cites and deletes only its own documents.",
                         no_args_is_help=True)
err = Console(stderr=True)


def _file():
    from mmrag.core.settings import Settings

    path = Settings().tenants.file
    if path is None:
        raise typer.BadParameter("set MMRAG_TENANTS_FILE to the tenants file to write (e.g. .mmrag/tenants.json); "
                                 "`mmrag serve` reads it at start-up", param_hint="MMRAG_TENANTS_FILE")
    return path


@tenant_app.command("add")
def add(tenant: Annotated[str, typer.Argument(help="Tenant name: 1-32 of a-z, 0-9, '_', '-'.")]) -> None:
    """Make a new API key for TENANT (the tenant too, if new) and print it once: only its SHA-256 is stored.

    Restart `mmrag serve` to take it into use. The tenant's documents go to collection
    MMRAG_QDRANT_COLLECTION--TENANT (`mmrag ingest --tenant TENANT` ingests into it from the command line).
    """
    from serving.api.tenants import add_key

    path = _file()
    try:
        key = add_key(path, tenant)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="TENANT") from None
    err.print(f"new key for tenant [bold]{tenant}[/] (shown once; its digest is in {path}):")
    typer.echo(key)


@tenant_app.command("list")
def list_(as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False) -> None:
    """Tenants, how many keys each has, and their collections."""
    from mmrag.core.settings import Settings
    from serving.api.tenants import read_tenants_file

    settings = Settings()
    tenants = {t: {"keys": len(d), "collection": settings.storage.tenant_collection(t), **q.as_json()}
               for t, (d, q) in sorted(read_tenants_file(_file()).items())}
    if as_json:
        typer.echo(json.dumps(tenants))
        return
    for t, info in tenants.items():
        bounds = ", ".join(f"{k} {v:g}" for k, v in info.items() if k not in ("keys", "collection"))
        err.print(f"{t}: {info['keys']} key(s), collection {info['collection']}" + (f"; {bounds}" if bounds else ""))


@tenant_app.command("quota")
def quota(
    tenant: Annotated[str, typer.Argument(help="The tenant (already added with `mmrag tenant add`).")],
    weight: Annotated[float | None, typer.Option(help="Its share of the questions in flight against the other "
                                                      "active tenants' (default 1).")] = None,
    questions_in_flight: Annotated[int | None, typer.Option(help="At most this many of its questions at once.")] = None,
    requests_per_s: Annotated[float | None, typer.Option(help="Its API requests a second (429 beyond).")] = None,
    documents: Annotated[int | None, typer.Option(help="Documents it may keep indexed (403 beyond).")] = None,
    pages: Annotated[int | None, typer.Option(help="Pages it may keep indexed (403 beyond).")] = None,
    bytes_: Annotated[int | None, typer.Option("--bytes", help="Bytes of uploads it may keep (413 beyond).")] = None,
    clear: Annotated[bool, typer.Option(help="Drop every share and bound first (back to weight 1, none).")] = False,
) -> None:
    """Set TENANT's share and bounds in the tenants file (read when `mmrag serve` starts). Options not given
    keep their value. Example: `mmrag tenant quota acme --weight 2 --questions-in-flight 16 --requests-per-s 10`."""
    from serving.api.tenants import TenantsFileError, set_quota

    changes = {"weight": weight, "questions_in_flight": questions_in_flight, "requests_per_s": requests_per_s,
               "documents": documents, "pages": pages, "bytes": bytes_}
    try:
        result = set_quota(_file(), tenant, {k: v for k, v in changes.items() if v is not None}, clear=clear)
    except TenantsFileError as exc:
        raise typer.BadParameter(str(exc), param_hint="TENANT") from None
    err.print(f"tenant [bold]{tenant}[/]: {result.as_json() or 'weight 1, no bounds'} (restart `mmrag serve` to "
              "apply)")


@tenant_app.command("remove")
def remove(tenant: Annotated[str, typer.Argument(help="The tenant whose keys to drop.")]) -> None:
    """Drop every key of TENANT (after a restart of `mmrag serve` they are refused). Its collection stays:
    `mmrag index reset --tenant TENANT` empties it."""
    from serving.api.tenants import remove_tenant

    if not remove_tenant(_file(), tenant):
        raise typer.BadParameter(f"no tenant {tenant!r} in the tenants file (`mmrag tenant list` shows them)",
                                 param_hint="TENANT")
    err.print(f"tenant {tenant}: keys removed")


def _tenant_name(value: str) -> str:
    from mmrag.core.settings import check_tenant

    try:
        return check_tenant(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


# `--tenant` of the commands that read or write one collection (ingest, ask, index, reencode).
TenantOption = Annotated[str, typer.Option(
    "--tenant", callback=_tenant_name, help="Act on this tenant's collection (MMRAG_QDRANT_COLLECTION--TENANT; "
    "`default`: MMRAG_QDRANT_COLLECTION itself). See `mmrag tenant --help`.")]
