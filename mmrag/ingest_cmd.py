"""Wiring for `mmrag ingest` and `mmrag index`: build the parts from Settings, show progress, print the report."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from core.settings import Settings
from ingestion.embed import ImageEmbedder, TextEmbedder, clip_embed_dim
from ingestion.index import PageIndex, open_qdrant
from ingestion.model_source import resolve_model
from ingestion.pipeline import STAGES, IngestReport, Ingestor
from ingestion.store import open_feature_store
from ingestion.vision import VisionEncoder


def open_index(settings: Settings, text_dim: int) -> PageIndex:
    index = PageIndex(
        open_qdrant(settings.qdrant_url, settings.qdrant_path),
        settings.qdrant_collection,
        text_dim=text_dim,
        image_dim=clip_embed_dim(settings.clip_model),
    )
    index.ensure_collection()
    return index


def build_ingestor(settings: Settings, console: Console) -> Ingestor:
    model = resolve_model(settings)
    console.print(f"model: {model.describe()}")
    encoder = VisionEncoder(model.path, settings.resolution_policy, salt=settings.encoder_salt)
    text = TextEmbedder(settings.text_embedder, batch_size=settings.embed_batch_size)
    image = None
    if settings.image_channel:
        image = ImageEmbedder(settings.clip_model, settings.clip_weights, batch_size=settings.embed_batch_size)
        console.print(f"image channel: on ({image.name})")
    else:
        console.print("image channel: off (no CLIP weights; set MMRAG_CLIP_WEIGHTS to a local open_clip file)")
    return Ingestor(
        settings,
        encoder=encoder,
        store=open_feature_store(settings.data_dir, settings.redis_url),
        index=open_index(settings, text.dim),
        text_embedder=text,
        image_embedder=image,
    )


def run(paths: list[Path], *, recursive: bool, console: Console, show_progress: bool) -> IngestReport:
    settings = Settings()
    ingestor = build_ingestor(settings, console)
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


def reset_index(console: Console) -> None:
    settings = Settings()
    text = TextEmbedder(settings.text_embedder)
    index = PageIndex(open_qdrant(settings.qdrant_url, settings.qdrant_path), settings.qdrant_collection,
                      text_dim=text.dim, image_dim=clip_embed_dim(settings.clip_model))
    index.reset()
    console.print(f"collection {settings.qdrant_collection} re-created (empty)")


def stats() -> dict:
    settings = Settings()
    client = open_qdrant(settings.qdrant_url, settings.qdrant_path)
    points = client.count(settings.qdrant_collection).count if client.collection_exists(settings.qdrant_collection) else 0
    store = open_feature_store(settings.data_dir, settings.redis_url)
    return {"pages": points, "feature_entries": sum(1 for _ in store.keys()), "store": store.backend}
