"""`mmrag tenant add|list|remove`: the API keys of each tenant, in MMRAG_TENANTS_FILE (serving/api/tenants.py).

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
    from core.settings import Settings

    path = Settings().tenants_file
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
    from core.settings import Settings
    from serving.api.tenants import read_tenants

    settings = Settings()
    tenants = {t: {"keys": len(d), "collection": settings.tenant_collection(t)}
               for t, d in sorted(read_tenants(_file()).items())}
    if as_json:
        typer.echo(json.dumps(tenants))
        return
    for t, info in tenants.items():
        err.print(f"{t}: {info['keys']} key(s), collection {info['collection']}")


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
    from core.settings import check_tenant

    try:
        return check_tenant(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


# `--tenant` of the commands that read or write one collection (ingest, ask, index, reencode).
TenantOption = Annotated[str, typer.Option(
    "--tenant", callback=_tenant_name, help="Act on this tenant's collection (MMRAG_QDRANT_COLLECTION--TENANT; "
    "`default`: MMRAG_QDRANT_COLLECTION itself). See `mmrag tenant --help`.")]
