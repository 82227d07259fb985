"""`mmrag reencode`: re-encode the pages another vision encoder made, for the configured one (ingestion/reencode.py).

Registered in mmrag/cli.py as ``app.command("reencode")(reencode)``; importing this module imports nothing
heavy (the command imports torch and Qdrant inside), so `mmrag --help` stays fast.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mmrag.tenant_cmd import TenantOption

if TYPE_CHECKING:
    from mmrag.core.settings import Settings
    from ingestion.reencode import ReencodeReport

err = Console(stderr=True)


def reencode(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only say what would be re-encoded (pages per old "
                                          "encoder, vision forwards needed); render and encode nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the summary.")] = False,
    tenant: TenantOption = "default",
) -> None:
    """Re-encode the pages another vision encoder made, for the configured one.

    After a model or projector upgrade, a changed MMRAG_ENCODER_SALT,
    MMRAG_MIN_PIXELS or MMRAG_MAX_PIXELS, or another image preprocessing
    (a transformers upgrade, torchvision installed or removed; also keys
    from before the encoder version covered preprocessing), those pages are
    never served (`mmrag index check` counts them). This renders each one again from its
    source file, encodes it, stores its tokens, and only then switches the
    page to the new key. Text and vectors stay as they are: no embedder loads.

    With MMRAG_IMAGE_INPUT=pixels it then gives the configured encoder's
    entries their pixels where they lack them (an index ingested in the
    embeds form, switched to the pixels form): each page is rendered again,
    no vision forward, keys unchanged.

    Pages whose source file changed or is gone are left as they are and
    listed: `mmrag ingest PATH` re-ingests them. A killed run can simply be
    run again. Old entries stay in the store until `mmrag store gc --apply`.
    Stop `mmrag serve` first (Qdrant local mode allows one process per index).

    With tenants, run it once per tenant (`mmrag tenant list`): each has its own collection.

    Exit code 1 if any page could not be re-encoded (all others are).
    """
    from mmrag import wiring

    settings, scope = wiring.for_tenant(tenant)
    report = run(settings, collection=scope.collection, dry_run=dry_run,
                 show_progress=not as_json or sys.stderr.isatty())
    if as_json:
        typer.echo(json.dumps(report.to_json()))
    else:
        print_report(report, err)
    raise typer.Exit(1 if report.skipped else 0)


def run(settings: Settings, *, dry_run: bool, show_progress: bool, collection: str | None = None
        ) -> ReencodeReport:
    """``collection``: a tenant's (None: the default tenant's)."""
    from ingestion import reencode as reencoding
    from mmrag import wiring

    model = wiring.resolve_model(settings)
    err.print(f"model: {model.describe()}")
    store = wiring.feature_store(settings)
    # The tower is loaded either way (the encoder version hashes its weights); a dry run does no forward.
    encoder = None if dry_run else wiring.vision_encoder(settings, model)
    index = wiring.read_index(settings, collection=collection)  # no embedder: vectors are never written
    try:
        if not index.client.collection_exists(index.collection):
            scope = wiring.encoder_scope(settings, model)
            return reencoding.ReencodeReport(str(scope), dry_run=dry_run)
        index.backfill_encoder_fields()  # an index written before the encoder fields existed gets them
        if encoder is None:
            return reencoding.dry_run(index, store, wiring.encoder_scope(settings, model), settings.vision.tier_table,
                                      pixels=settings.engine.image_input == "pixels")
        reencoder = wiring.reencoder(settings, encoder=encoder, store=store, index=index)
        with Progress(
            TextColumn("[bold]reencode"), BarColumn(), MofNCompleteColumn(), TextColumn("pages"),
            TextColumn("{task.fields[rate]:.1f} pages/s"), TimeElapsedColumn(),
            console=err, disable=not show_progress, transient=False,
        ) as bar:
            task = bar.add_task("reencode", total=None, rate=0.0)

            def on_progress(done: int, total: int) -> None:
                elapsed = bar.tasks[0].elapsed or 1e-9
                bar.update(task, total=total, completed=done, rate=done / elapsed)

            return reencoder.run(progress=on_progress)
    finally:
        index.client.close()


def print_report(report: ReencodeReport, console: Console) -> None:
    from ingestion.reencode import SKIPPED_FIX

    console.print(f"configured encoder: {report.encoder}; indexed pages: {report.pages}, "
                  f"already current: {report.current}")
    for encoder, pages in report.stale_by_encoder.items():
        console.print(f"  {pages} pages of encoder {encoder}")
    if report.dry_run:
        console.print(f"would re-encode {report.to_reencode} pages from {report.files} files "
                      f"({report.encoded} vision forwards); run `mmrag reencode` to do it")
    else:
        console.print(f"re-encoded {report.reencoded} pages from {report.files} files in {report.seconds:.1f} s: "
                      f"{report.encoded} vision forwards, {report.reused} tokens already stored")
    if report.without_pixels:  # the pixels form
        verb = "would give" if report.dry_run else "gave"
        done = "" if report.dry_run else f" {report.pixels_added} entries"
        console.print(f"{verb}{done} the pixels of {report.without_pixels} pages whose entries lacked them "
                      "(MMRAG_IMAGE_INPUT=pixels; no vision forward)")
    for skipped in report.skipped:
        console.print(f"[red]not re-encoded[/] {skipped.path} page {skipped.page}: {skipped.reason}")
    if report.skipped:
        console.print(f"[yellow]{len(report.skipped)} pages not re-encoded[/] (still not served): {SKIPPED_FIX}")
    if report.unreferenced_entries:
        console.print(f"run `mmrag store gc --apply` to free {report.unreferenced_entries} old entries "
                      "no page references any more")
