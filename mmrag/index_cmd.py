"""`mmrag index check`: which vision encoders made the indexed pages, and which the configured model serves.

A page's image tokens are usable only by the encoder that made them (its ImageKey names the encoder version
and the resolution policy); after a model or projector upgrade, or a changed MMRAG_ENCODER_SALT or pixel
bound, the old pages are excluded from serving until they are re-encoded (`mmrag reencode`). This shows how many
that is, and which of them carry an old key format: the configured encoder's own keys from before its version
covered the preprocessing implementation (mmrag/adapters/vision.py preprocessing_fingerprint). In the pixels form
(MMRAG_IMAGE_INPUT=pixels) also the servable pages whose entries lack their pixels (ingested in the embeds form).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from mmrag.core.payload import STALE_PAGES_FIX, WITHOUT_PIXELS_FIX, EncoderScope, pages_per_encoder
from mmrag.core.settings import Settings
from mmrag import wiring


@dataclass(slots=True, frozen=True)
class EncoderPages:
    encoder: EncoderScope
    pages: int
    documents: int
    servable: bool  # the configured model's encoder made these pages
    old_format: bool = False  # ... under a version from before it covered preprocessing: an old key format
    figures: int = 0  # figure entries of these pages (their crops' keys name the same encoder as their pages')

    def to_json(self) -> dict[str, Any]:
        return {"encoder_version": self.encoder.version, "policy": str(self.encoder.policy), "pages": self.pages,
                "figures": self.figures, "documents": self.documents, "servable": self.servable,
                "old_format": self.old_format}


@dataclass(slots=True, frozen=True)
class IndexCheck:
    serving: EncoderScope  # the configured model's encoder
    family: str
    encoders: list[EncoderPages]  # most pages first
    without_pixels: int | None = None  # the pixels form: servable pages whose entries lack their pixels

    @property
    def pages(self) -> int:
        return sum(e.pages for e in self.encoders)

    @property
    def stale_pages(self) -> int:
        return sum(e.pages for e in self.encoders if not e.servable)

    @property
    def old_format_pages(self) -> int:
        return sum(e.pages for e in self.encoders if e.old_format)

    def to_json(self) -> dict[str, Any]:
        return {
            "serving": {"encoder_version": self.serving.version, "policy": str(self.serving.policy),
                        "family": self.family},
            "pages": self.pages,
            "stale_pages": self.stale_pages,
            "encoders": [e.to_json() for e in self.encoders],
            "without_pixels": self.without_pixels,
            "fix": " ".join(fix for fix, needed in ((STALE_PAGES_FIX, self.stale_pages),
                                                    (WITHOUT_PIXELS_FIX, self.without_pixels)) if needed),
        }


def check(settings: Settings, *, collection: str | None = None) -> IndexCheck:
    """Pages per (encoder version, resolution policy) in the index (``collection``: a tenant's; None: the
    default tenant's), against the configured model's encoder.
    Reads the tower's weights to hash them (no forward; one pass gives today's version and the one before it
    covered preprocessing) and every page payload (no vectors)."""
    model = wiring.resolve_model(settings)
    serving = wiring.encoder_scope(settings, model)
    before_preprocessing = wiring.encoder_scope(settings, model, before_preprocessing=True)
    index = wiring.read_index(settings, collection=collection)
    try:
        pages = index.pages() if index.client.collection_exists(index.collection) else []
    finally:
        index.client.close()
    counts = pages_per_encoder(pages)
    docs: dict[EncoderScope, set[str]] = defaultdict(set)
    figures: dict[EncoderScope, int] = defaultdict(int)
    for page in pages:
        docs[EncoderScope.of(page.image_key)].add(page.doc_id)
        figures[EncoderScope.of(page.image_key)] += len(page.figures)
    encoders = [EncoderPages(scope, n, len(docs[scope]), scope == serving, scope == before_preprocessing,
                             figures[scope])
                for scope, n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))]
    without_pixels = None
    if settings.engine.image_input == "pixels":
        from mmrag.adapters.store import ScopedFeatureStore
        from ingestion.reencode import pages_without_pixels

        without_pixels = len(pages_without_pixels(pages, ScopedFeatureStore(wiring.feature_store(settings), serving)))
    return IndexCheck(serving, wiring.model_family(model), encoders, without_pixels)


def print_check(result: IndexCheck, console: Console) -> None:
    console.print(f"configured encoder: {result.serving.version} ({result.family}), policy {result.serving.policy}")
    table = Table(title="indexed pages per encoder", show_header=True)
    for column in ("encoder version", "policy", "pages", "figures", "documents", "servable"):
        table.add_column(column, justify="right" if column in ("pages", "figures", "documents") else "left")
    for e in result.encoders:
        table.add_row(e.encoder.version, str(e.encoder.policy), str(e.pages), str(e.figures), str(e.documents),
                      "yes" if e.servable else "[red]no, old key format[/]" if e.old_format else "[red]no[/]")
    console.print(table)
    if result.old_format_pages:
        console.print(f"{result.old_format_pages} pages carry keys this encoder minted before its version covered "
                      "preprocessing (the image processor's class and output): their tokens may differ from what it "
                      "makes now")
    if result.stale_pages:
        console.print(f"[yellow]{result.stale_pages} of {result.pages} pages cannot be served[/] (never retrieved "
                      f"nor fed to the model): {STALE_PAGES_FIX}")
    elif not result.pages:
        console.print("no pages indexed yet: run `mmrag ingest PATH...`")
    if result.without_pixels:
        console.print(f"[yellow]{result.without_pixels} pages have entries without their pixels[/] (ingested in the "
                      f"embeds form; MMRAG_IMAGE_INPUT=pixels cannot send them): {WITHOUT_PIXELS_FIX}")
