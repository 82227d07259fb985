"""`mmrag reencode`: give every indexed page the image tokens of the configured vision encoder, in place.

After a model or projector upgrade (or a changed MMRAG_ENCODER_SALT, pixel bound or image preprocessing, or
keys minted before the encoder version covered preprocessing) the pages' image keys name the old encoder, and
serving excludes them (mmrag/core/payload.py, EncoderScope). Only their image tokens are stale: their text, OCR and
vectors are not, so this renders each stale page's image again from its source file, encodes it, and switches the
page's payload to the new key, without loading any embedder.

Per batch of pages, in this order, so a run killed at any point and run again ends exactly where an
uninterrupted run ends:
1. render the pages from their source file (each file opened once) and check the file's sha256 and each
   page's content hash against the index: a page whose source changed is left untouched and reported;
2. encode the pages whose new key the store lacks (one vision forward each) and store them. Entries are
   content-addressed, so an entry left by a killed run is whole and reused without a forward;
3. only then switch each page's payload fields (image key, encoder fields, image_tokens, fingerprint), one
   page at a time: a page whose tokens could not be stored keeps its old key. Text and vectors are never
   written, and old entries stay in the store until `mmrag store gc --apply`.

In the pixels form (MMRAG_IMAGE_INPUT=pixels) every served entry also keeps its image's pixels, which an index
ingested in the embeds form lacks. So a run in that form then gives the configured encoder's entries their pixels,
with no vision forward: it renders each such page again (and crops its figures), checks the content hashes, and
writes each entry again with its tokens and the lossless PNG of the very image its key names. Entries are whole
either way (each write replaces one entry at once), so a killed run leaves entries with or without pixels and a
rerun finishes it. Keys stay the same; no payload changes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmrag.adapters.qdrant import PageIndex
from mmrag.adapters.store import FeatureStore, FeatureStoreError, ScopedFeatureStore
from mmrag.adapters.vision import VisionEncoder
from mmrag.adapters.vision_client import png_bytes
from mmrag.core.figures import PageFigure
from mmrag.core.keys import ImageKey, Tiers
from mmrag.core.pages import RenderedPage
from mmrag.core.payload import EncoderScope, PagePayload
from mmrag.core.settings import DocumentSettings, default_of
from ingestion.loaders import Document, IngestError, open_document
from ingestion.pipeline import batches, encoder_fingerprint, missing_keys

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)

SKIPPED_FIX = (
    "re-ingest those files with `mmrag ingest PATH...` (it renders, encodes and embeds them anew); a file that is "
    "gone stays unservable until it is ingested from where it is now"
)
FILE_CHANGED = "the file changed since it was indexed (its sha256 differs)"
FILE_UNREADABLE = "its source file cannot be opened"
PAGE_CHANGED = "the page renders differently than when it was indexed (the file or MMRAG_PDF_DPI changed)"
FIGURES_CHANGED = ("its figures crop differently than when it was indexed (MMRAG_FIGURES or the figure detector "
                   "changed)")

ProgressFn = Callable[[int, int], None]  # (pages done, pages to re-encode)


@dataclass(slots=True, frozen=True)
class SkippedPage:
    """A stale page left as it was, and why."""

    path: str
    page: int
    reason: str


@dataclass(slots=True)
class ReencodeReport:
    encoder: str  # the configured encoder's scope: what every re-encoded page now carries
    dry_run: bool
    pages: int = 0  # indexed pages
    current: int = 0  # already the configured encoder's before this run: nothing to do
    stale_by_encoder: dict[str, int] = field(default_factory=dict)  # pages to re-encode, per old encoder
    files: int = 0  # source files those pages come from
    reencoded: int = 0  # pages switched to the configured encoder
    encoded: int = 0  # vision forwards (in a dry run: the forwards it would take)
    reused: int = 0  # pages whose new tokens were stored already (a killed run's, or a page with the same image)
    skipped: list[SkippedPage] = field(default_factory=list)
    unreferenced_entries: int = 0  # store entries no page references any more: what `mmrag store gc` frees
    # The pixels form (MMRAG_IMAGE_INPUT=pixels): pages of the configured encoder whose entries lack their pixels,
    # and the entries given them (no vision forward).
    without_pixels: int = 0
    pixels_added: int = 0
    seconds: float = 0.0

    @property
    def to_reencode(self) -> int:
        return sum(self.stale_by_encoder.values())

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["skipped"] = [dataclasses.asdict(s) for s in self.skipped]
        out["seconds"] = round(self.seconds, 3)
        out["to_reencode"] = self.to_reencode
        out["fix"] = SKIPPED_FIX if self.skipped else ""
        return out


def dry_run(index: PageIndex, store: FeatureStore, scope: EncoderScope, tiers: Tiers, *, pixels: bool = False
            ) -> ReencodeReport:
    """What a run would do, from the index and the store alone (nothing is rendered or encoded): the stale
    pages per old encoder, and the vision forwards they need: one per distinct content hash that ``scope``'s
    encoder has stored no tokens for (a changed source file, found only by a run, needs none). The store's keys
    are listed rather than keys made up for ``scope``: only an encoder mints keys, and a dry run loads none.
    ``pixels`` (the pixels form): also the current pages whose entries lack their pixels."""
    report, stale = _plan(index, scope, dry_run=True)
    stored = {k.content_hash for k in ScopedFeatureStore(store, scope).keys()}
    report.encoded = len({k.content_hash for p in stale for k in p.image_keys} - stored)
    if pixels:
        report.without_pixels = len(pages_without_pixels(index.pages(), ScopedFeatureStore(store, scope)))
    report.unreferenced_entries = _unreferenced(index, store, tiers)
    return report


def pages_without_pixels(pages: Iterable[PagePayload], store: ScopedFeatureStore) -> list[PagePayload]:
    """The ``pages`` of ``store``'s encoder with an entry (the page's or a figure crop's) stored without its
    pixels, which the pixels form cannot send (`mmrag reencode` adds them). Pooled entries are left out: they are
    always sent as tokens (serving/engine/images.py)."""
    return [p for p in pages if store.covers(p.image_key) and any(
        not k.policy.pooled and store.has_pixels(k) is False for k in p.image_keys)]


def _plan(index: PageIndex, scope: EncoderScope, *, dry_run: bool) -> tuple[ReencodeReport, list[PagePayload]]:
    stale = index.pages_outside(scope)
    report = ReencodeReport(str(scope), dry_run=dry_run, pages=index.count())
    report.current = report.pages - len(stale)
    report.stale_by_encoder = dict(Counter(str(EncoderScope.of(p.image_key)) for p in stale).most_common())
    report.files = len({p.path for p in stale})
    return report, stale


def fingerprint_under(fingerprint: str, old: EncoderScope, new: EncoderScope) -> str | None:
    """``fingerprint`` with its encoder parts (ingestion/pipeline.encoder_fingerprint) naming ``new``: what
    `mmrag ingest` under the new encoder writes for the same page, so it finds the page current. None when the
    fingerprint does not start with ``old``'s parts (not written by this version of mmrag)."""
    prefix = encoder_fingerprint(old) + "|"
    if not fingerprint.startswith(prefix):
        return None
    return encoder_fingerprint(new) + "|" + fingerprint.removeprefix(prefix)


class Reencoder:
    """Re-encodes the stale pages of one index for one encoder; needs no embedder (vectors are never written)."""

    def __init__(self, documents: DocumentSettings, *, tiers: Tiers, pixels: bool, encoder: VisionEncoder,
                 store: FeatureStore, index: PageIndex, vision_batch_size: int = default_of("vision_batch_size")
                 ) -> None:
        """``documents``: how ingestion read the files (Settings.documents); ``tiers``: every tier's policy (an
        entry under one of them is still referenced); ``pixels``: replicas take pixels (MMRAG_IMAGE_INPUT), so
        new entries keep their PNG."""
        self.documents = documents
        self.tiers = tiers
        self.pixels = pixels
        self.vision_batch_size = vision_batch_size
        self.encoder = encoder
        self.store = store
        self.index = index
        self.scope = EncoderScope(encoder.version, encoder.policy)
        # Tokens are stored through the encoder's scope: a key it did not mint is refused, not filed.
        self._writer = ScopedFeatureStore(store, self.scope)
        # Only the image is needed, and OCR does not change it (nor its content hash): skip tesseract.
        self._render_documents = replace(documents, ocr=False)

    def run(self, *, progress: ProgressFn | None = None) -> ReencodeReport:
        started = time.perf_counter()
        report, stale = _plan(self.index, self.scope, dry_run=False)
        notify = progress or (lambda done, total: None)
        done = 0
        notify(0, len(stale))
        for path, pages in _by_source(stale).items():
            self._reencode_file(path, pages, report, lambda n: notify(done + n, len(stale)))
            done += len(pages)
            notify(done, len(stale))
        if self.pixels:  # after the re-encode: its new entries have their pixels
            self._add_pixels(report, notify)
        report.unreferenced_entries = _unreferenced(self.index, self.store, self.tiers)
        report.seconds = time.perf_counter() - started
        log.info("re-encoded %d pages for %s (%d vision forwards, %d reused, %d skipped; %d entries given their "
                 "pixels) in %.2f s", report.reencoded, self.scope, report.encoded, report.reused,
                 len(report.skipped), report.pixels_added, report.seconds)
        return report

    def _add_pixels(self, report: ReencodeReport, notify: ProgressFn) -> None:
        """Give every entry of the configured encoder's pages its pixels (see the module docstring)."""
        pages = pages_without_pixels(self.index.pages(), self._writer)
        report.without_pixels = len(pages)
        done = 0
        notify(0, len(pages))

        def put(doc: Document, pending: dict[int, PagePayload]) -> None:
            nonlocal done
            for rendered in self._renders(doc, pending, report):
                self._put_pixels(pending.pop(rendered.page), rendered, report)
                done += 1
                notify(done, len(pages))

        for path, group in _by_source(pages).items():
            self._each_file(path, group, report, _file_changed, put)

    def _put_pixels(self, page: PagePayload, rendered: RenderedPage, report: ReencodeReport) -> None:
        """Each of the page's entries without pixels written again with them: the page's image, each figure's
        crop (found again by its content hash), exactly the images their keys name."""
        crops = {c.content_hash: c.image for c in rendered.figures}
        images = [(page.image_key, rendered.image)] + [(f.image_key, crops.get(f.image_key.content_hash))
                                                        for f in page.figures]
        if any(image is None for _, image in images):
            self._skip(page, FIGURES_CHANGED, report)
            return
        for key, image in images:
            if key.policy.pooled or self._writer.has_pixels(key) is not False:
                continue  # tokens only by design, already given its pixels, or gone (a deletion since)
            value = self._writer.get(key)
            if value is None:
                continue
            self._writer.put(key, dataclasses.replace(value, pixels_png=png_bytes(image)))
            report.pixels_added += 1

    def _reencode_file(self, path: str, pages: list[PagePayload], report: ReencodeReport,
                       on_batch: Callable[[int], None]) -> None:
        def reencode(doc: Document, pending: dict[int, PagePayload]) -> None:
            done = 0
            for batch in batches(self._renders(doc, pending, report), self.vision_batch_size,
                                 self.documents.max_image_pixels):
                # A store failure raises before any page of the batch is switched: they stay pending.
                self._reencode_batch([(pending[r.page], r) for r in batch], report)
                for r in batch:
                    del pending[r.page]
                done += len(batch)
                on_batch(done)

        self._each_file(path, pages, report, lambda page, doc: _unchangeable(page, doc, self.scope), reencode)

    def _each_file(self, path: str, pages: list[PagePayload], report: ReencodeReport,
                   unchangeable: Callable[[PagePayload, Document], str],
                   work: Callable[[Document, dict[int, PagePayload]], None]) -> None:
        """Open ``path`` once, report each of ``pages`` it can no longer serve (``unchangeable`` says why), and
        hand ``work`` the document and the rest, by page number; ``work`` takes each page out as it is done. A
        file gone, unreadable or damaged, or the store unreachable, reports what is left (the next file tries
        again)."""
        pending = {p.page: p for p in pages}  # left out of `report` so far
        try:
            with open_document(Path(path), self._render_documents) as doc:
                for page in pages:
                    reason = unchangeable(page, doc)
                    if reason:
                        self._skip(pending.pop(page.page), reason, report)
                work(doc, pending)
        except IngestError as exc:
            self._skip_all(pending, f"{FILE_UNREADABLE}: {exc}", report)
        except FeatureStoreError as exc:
            self._skip_all(pending, str(exc), report)

    def _renders(self, doc: Document, pending: dict[int, PagePayload], report: ReencodeReport
                 ) -> Iterator[RenderedPage]:
        """The pending pages rendered, in page order, no other page rendered; a page whose image changed is
        reported instead."""
        for number in sorted(pending):  # a snapshot: pages leave ``pending`` as their batches are done
            page = pending.get(number)
            rendered = doc.page(number) if page is not None else None
            if rendered is None:
                continue
            if rendered.content_hash != page.content_hash:
                self._skip(pending.pop(page.page), PAGE_CHANGED, report)
                continue
            yield rendered

    def _reencode_batch(self, batch: list[tuple[PagePayload, RenderedPage]], report: ReencodeReport) -> None:
        keys = [self.encoder.key_for(rendered.content_hash) for _, rendered in batch]
        # Each indexed figure's crop, found again by its content hash among the page's crops (None: not found).
        crops = [[{c.content_hash: c for c in rendered.figures}.get(f.image_key.content_hash) for f in page.figures]
                 for page, rendered in batch]
        found = [c for cs in crops for c in cs if c is not None]
        crop_keys = [self.encoder.key_for(c.content_hash) for c in found]
        failed = self._store_missing([r.image for _, r in batch] + [c.image for c in found], keys + crop_keys, report)
        for (page, rendered), key, page_crops in zip(batch, keys, crops):
            if any(c is None for c in page_crops):
                self._skip(page, FIGURES_CHANGED, report)
                continue
            figures = tuple(dataclasses.replace(f, image_key=self.encoder.key_for(c.content_hash),
                                                image_tokens=self.encoder.num_tokens_for(c.image))
                            for f, c in zip(page.figures, page_crops))
            lost = [k for k in (key, *(f.image_key for f in figures)) if k in failed]
            if lost:  # its tokens are not stored: it keeps its old keys, still valid for the old encoder
                self._skip(page, f"its new image tokens could not be stored: {failed[lost[0]]}", report)
                continue
            self._switch(page, rendered, key, figures)
            report.reencoded += 1

    def _store_missing(self, images: list[Image.Image], keys: list[ImageKey], report: ReencodeReport
                       ) -> dict[ImageKey, str]:
        """Encode and store the keys the store lacks (a repeated image once); the keys that failed, with why."""
        missing, reused = missing_keys(self.store, images, keys)
        report.reused += reused
        failed: dict[ImageKey, str] = {}
        for key, value in zip(missing, self.encoder.encode(list(missing.values()))):
            try:
                self._writer.put(key, value)
            except FeatureStoreError as exc:
                failed[key] = str(exc)
        report.encoded += len(missing)
        return failed

    def _switch(self, page: PagePayload, rendered: RenderedPage, key: ImageKey, figures: tuple[PageFigure, ...]
                ) -> None:
        new = dataclasses.replace(
            page, image_key=key, image_tokens=self.encoder.num_tokens_for(rendered.image), figures=figures,
            width=rendered.image.width, height=rendered.image.height,
            fingerprint=fingerprint_under(page.fingerprint, EncoderScope.of(page.image_key), self.scope),
        )
        before, after = page.to_qdrant(), new.to_qdrant()
        self.index.set_page_fields(page.page_id, {k: v for k, v in after.items() if before[k] != v})

    def _skip_all(self, pending: dict[int, PagePayload], reason: str, report: ReencodeReport) -> None:
        for page in pending.values():
            self._skip(page, reason, report)

    @staticmethod
    def _skip(page: PagePayload, reason: str, report: ReencodeReport) -> None:
        log.warning("not re-encoded: %s page %d: %s", page.path, page.page, reason)
        report.skipped.append(SkippedPage(page.path, page.page, reason))


def _by_source(pages: list[PagePayload]) -> dict[str, list[PagePayload]]:
    """``pages`` by source file (each file opened once), in page order."""
    out: dict[str, list[PagePayload]] = defaultdict(list)
    for page in sorted(pages, key=lambda p: (p.path, p.page)):
        out[page.path].append(page)
    return out


def _file_changed(page: PagePayload, doc: Document) -> str:
    """Why ``page``'s image cannot be rendered again from ``doc``; empty when it can."""
    return FILE_CHANGED if page.file_sha256 != doc.file_sha256 else ""


def _unchangeable(page: PagePayload, doc: Document, scope: EncoderScope) -> str:
    """Why ``page`` cannot be re-encoded from ``doc`` without re-ingesting it; empty when it can."""
    if _file_changed(page, doc):
        return FILE_CHANGED
    if fingerprint_under(page.fingerprint, EncoderScope.of(page.image_key), scope) is None:
        return f"its fingerprint {page.fingerprint!r} was not written by this version of mmrag ingest"
    return ""


def _unreferenced(index: PageIndex, store: FeatureStore, tiers: Tiers) -> int:
    """Entries `mmrag store gc` would remove: neither an indexed page's key nor its page's entry in a tier."""
    in_use = tiers.in_use(k for p in index.pages() for k in p.image_keys)
    return sum(not in_use(k) for k in store.keys())
