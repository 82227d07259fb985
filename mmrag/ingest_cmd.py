"""`mmrag ingest` and `mmrag index`: parts from mmrag/wiring/, progress, the report."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mmrag.core.settings import DEFAULT_TENANT
from mmrag import wiring

if TYPE_CHECKING:
    from ingestion.pipeline import IngestReport


def run(paths: list[Path], *, recursive: bool, console: Console, show_progress: bool,
        tiers: Sequence[str] = (), tenant: str = DEFAULT_TENANT) -> IngestReport:
    """``tiers`` (``--tier``): resolution tiers to encode the pages in besides MMRAG_INGEST_TIERS."""
    settings, scope = wiring.for_tenant(tenant)
    if tiers:
        from mmrag.ask_cmd import check_tier

        tiers = tuple(check_tier(settings, t) for t in tiers)
    model = wiring.resolve_model(settings)
    console.print(f"model: {model.describe()}")
    ingestor = wiring.ingestor(settings, collection=scope.collection, model=model, tiers=tuple(tiers))
    if ingestor.image_embedder is not None:
        console.print(f"image channel: on ({ingestor.image_embedder.name})")
    else:
        console.print("image channel: off (no CLIP weights; set MMRAG_CLIP_WEIGHTS to a local open_clip file)")
    with Progress(
        TextColumn("[bold]ingest"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
        TextColumn("{task.fields[pages]} pages, {task.fields[rate]:.1f} pages/s"), TimeElapsedColumn(),
        console=console, disable=not show_progress, transient=False,
    ) as bar:
        task = bar.add_task("ingest", total=None, pages=0, rate=0.0)

        def on_progress(files_done: int, files_total: int, pages_done: int) -> None:
            elapsed = bar.tasks[0].elapsed or 1e-9
            bar.update(task, total=files_total, completed=files_done, pages=pages_done, rate=pages_done / elapsed)

        return ingestor.run(paths, recursive=recursive, progress=on_progress)


def print_report(report: IngestReport, console: Console) -> None:
    from ingestion.pipeline import STAGES

    table = Table(title="ingest", show_header=True)
    for col in ("files", "pages", "encoded", "cached", "failed", "seconds", "pages/s"):
        table.add_column(col, justify="right")
    rate = report.pages / report.seconds if report.seconds else 0.0
    table.add_row(str(report.files), str(report.pages), str(report.encoded), str(report.cached),
                  str(len(report.failed)), f"{report.seconds:.1f}", f"{rate:.1f}")
    console.print(table)
    stages = ", ".join(f"{s} {report.stage_seconds[s]:.2f}s" for s in STAGES)
    console.print(f"time by stage: {stages}; OCR pages: {report.ocr_pages}; unchanged files: {report.unchanged_files}")
    for failure in report.failed:
        console.print(f"[red]failed[/] {failure.path}: {failure.error}")


def reset_index(console: Console, tenant: str = DEFAULT_TENANT) -> None:
    settings, scope = wiring.for_tenant(tenant)
    late = wiring.late_retriever(settings)
    index = wiring.page_index(settings, wiring.text_embedder(settings).dim, collection=scope.collection,
                              late_dim=late.dim if late else 0)
    try:
        index.reset()
    finally:
        index.client.close()
    console.print(f"collection {index.collection} re-created (empty)")


def stats(tenant: str = DEFAULT_TENANT) -> dict:
    settings, scope = wiring.for_tenant(tenant)
    index = wiring.read_index(settings, collection=scope.collection)
    try:
        pages = index.count() if index.client.collection_exists(index.collection) else 0
    finally:
        index.client.close()
    store = wiring.feature_store(settings)
    return {"pages": pages, "feature_entries": sum(1 for _ in store.keys()), "store": store.backend}
