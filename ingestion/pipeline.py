"""`mmrag ingest`: files → rendered pages → image tokens (FeatureStore) + vectors (Qdrant).

Per file, in this order, so a run killed at any point and re-run ends with exactly the store an
uninterrupted run makes:
1. open and validate the file (bad input fails here, before anything is written);
2. skip it if the index already holds all its pages for the same file bytes and the same fingerprint
   (encoder version, resolution policy, DPI, OCR, embedders) and their image tokens are still stored;
3. per batch of pages: lease the pages' ImageKeys (a KeyLease), then encode the pages whose key the store lacks
   (one vision forward each) and write each entry atomically — entries are content-addressed, so an entry left by
   a killed run is whole and reused; the same for each extra resolution tier (MMRAG_INGEST_TIERS: its keys in the
   store, not in the index, whose points carry the standard tier's key; a file missing a tier's entries is not
   current);
4. upsert all the file's points at once, then drop pages the file no longer has, then end the lease. A file that
   fails half-way writes no point, so no partial document is ever searchable.

The lease spans the time a page's tokens are stored (or found stored) but not yet referenced by an indexed page:
a deletion meanwhile — of any tenant's document, or `mmrag store gc`, in any process sharing the store — sees
them unreferenced, and the lease is what keeps it from removing them under the ingest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmrag.core.figures import Caption, FigureRegion, PageFigure, figure_mentions, figure_text
from mmrag.core.figures import captions as find_captions
from mmrag.core.keys import ImageKey, KeyLease
from mmrag.core.pages import RenderedPage, TextSource
from mmrag.core.settings import DocumentSettings, default_of
from mmrag.core.payload import IMAGE_VECTOR, LEXICAL_VECTOR, PAGE_MEAN_VECTOR, PAGE_VECTOR, TEXT_VECTOR, EncoderScope, PagePayload
from mmrag.core.text import TEXT_VERSION
from mmrag.adapters.embed import ImageEmbedder, TextEmbedder
from mmrag.adapters.late import LateInteractionRetriever, mean_pool, pool_tokens
from mmrag.adapters.lexical import LexicalEncoder
from mmrag.adapters.qdrant import PageIndex, make_point
from ingestion.figures import FIGURES_VERSION
from ingestion.loaders import Document, FileFailure, IngestError, discover, open_document
from mmrag.adapters.store import FeatureStore, FeatureStoreError, ScopedFeatureStore, StoreLease
from mmrag.adapters.vision import VisionEncoder

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)

STAGES = ("render", "text", "figures", "ocr", "encode", "embed", "index")
# How long an ingest's lease on a file's keys outlives an ingest killed before indexing them. Renewed while the
# file ingests (every quarter of it), so only a killed ingest's leases run out.
INGEST_LEASE_S = 3600.0


@dataclass(slots=True)
class IngestReport:
    files: int = 0
    pages: int = 0
    encoded: int = 0  # vision forwards: pages newly encoded (once per tier with MMRAG_INGEST_TIERS)
    cached: int = 0  # pages whose image tokens were already stored (likewise per tier)
    figures: int = 0  # figure crops of the pages (MMRAG_FIGURES), each an image entry of its own
    figures_encoded: int = 0  # vision forwards for figure crops (a figure stored already, e.g. from another file: 0)
    failed: list[FileFailure] = field(default_factory=list)
    seconds: float = 0.0
    unchanged_files: int = 0
    ocr_pages: int = 0
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    # Pages kept with their image and text but no figures: over the figure step's bounds (ingestion/figures.py).
    figures_skipped: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "pages": self.pages,
            "encoded": self.encoded,
            "cached": self.cached,
            "figures": self.figures,
            "figures_encoded": self.figures_encoded,
            "failed": [asdict(f) for f in self.failed],
            "seconds": round(self.seconds, 3),
            "unchanged_files": self.unchanged_files,
            "ocr_pages": self.ocr_pages,
            "stage_seconds": {k: round(v, 3) for k, v in self.stage_seconds.items()},
            "figures_skipped": self.figures_skipped,
        }


ProgressFn = Callable[[int, int, int], None]  # (files done, files in all, pages done)


class Ingestor:
    def __init__(
        self,
        documents: DocumentSettings,
        *,
        vision_batch_size: int = default_of("vision_batch_size"),
        encoder: VisionEncoder,
        store: FeatureStore,
        index: PageIndex,
        text_embedder: TextEmbedder,
        image_embedder: ImageEmbedder | None = None,
        tier_encoders: Sequence[VisionEncoder] = (),
        lease: Callable[[], KeyLease] | None = None,
        lexical: LexicalEncoder | None = None,
        late: LateInteractionRetriever | None = None,
        late_pool_factor: int = 1,
    ) -> None:
        """``documents``: how files are read (Settings.documents); ``vision_batch_size``: pages per encoder batch.
        ``tier_encoders``: the encoder under each extra tier's policy (``VisionEncoder.with_policy``).
        ``lease``: a new lease per file on its pages' keys (default: a StoreLease on ``store``, INGEST_LEASE_S).
        ``lexical``: the sparse BM25 encoder (default: LexicalEncoder()). ``late``: the late-interaction page-image
        retriever (instead of ``image_embedder``), its page vectors pooled to 1/``late_pool_factor`` of their rows."""
        if image_embedder is not None and late is not None:
            raise ValueError("the page-image channel is CLIP or a late-interaction retriever, not both")
        self.documents = documents
        self.vision_batch_size = vision_batch_size
        self._new_lease = lease or (lambda: StoreLease(store, "ingest", INGEST_LEASE_S))
        self.encoder = encoder
        self.tier_encoders = list(tier_encoders)
        self.store = store
        self.index = index
        self.text_embedder = text_embedder
        self.image_embedder = image_embedder
        self.lexical = lexical or LexicalEncoder()
        self.late = late
        self.late_pool_factor = late_pool_factor
        page_channel = (image_embedder.name if image_embedder else f"late:{late.name}/pool{late_pool_factor}" if late
                        else "off")
        self.fingerprint = "|".join([
            encoder_fingerprint(EncoderScope(encoder.version, encoder.policy)), f"dpi={documents.pdf_dpi}",
            f"ocr={documents.ocr and documents.ocr_lang}", f"text={text_embedder.name}",
            f"image={page_channel}", f"lexical={self.lexical.version}", f"text_norm={TEXT_VERSION}",
            # Figure points carry their crop's page-image vectors where that channel is on (an index from before
            # has figure points without them: its documents re-ingest, re-embedding only).
            f"figures={FIGURES_VERSION + ('+image' if page_channel != 'off' else '') if documents.figures else 'off'}",
        ])

    def run(self, paths: Iterable[Path], *, recursive: bool = False, progress: ProgressFn | None = None,
            root: Path | None = None) -> IngestReport:
        """``root``: files must resolve inside it (server-side ingest: links cannot leave MMRAG_INGEST_ROOT)."""
        started = time.perf_counter()
        files, failures = discover(list(paths), recursive=recursive, root=root)
        report = IngestReport(files=len(files) + len(failures), failed=list(failures))
        total = len(files)
        notify = progress or (lambda files_done, files_total, pages_done: None)
        for failure in failures:
            log.warning("failed %s: %s", failure.path, failure.error)
        for i, path in enumerate(files):
            try:
                self.ingest_file(path, report, on_batch=lambda in_file: notify(i, total, report.pages + in_file))
            except (IngestError, FeatureStoreError) as exc:  # a full disk fails this file, not the run
                report.failed.append(FileFailure.of(path, str(exc)))
                log.warning("failed %s: %s", path, exc)
            except Exception as exc:  # noqa: BLE001  anything else one file raises fails that file, not the run
                report.failed.append(FileFailure.of(path, unexpected(exc)))
                log.warning("failed %s: %s", path, unexpected(exc))
                log.debug("failed %s", path, exc_info=exc)
            notify(i + 1, total, report.pages)
        report.seconds = time.perf_counter() - started
        return report

    def ingest_file(self, path: Path, report: IngestReport, *, on_batch: Callable[[int], None] | None = None
                    ) -> None:
        """``path`` indexed into ``report``; ``on_batch(pages done in the file)`` after each batch of pages and
        between two pages' loads (:func:`_between`)."""
        started = time.perf_counter()
        with open_document(path, self.documents) as doc:
            if self._is_current(doc):
                report.pages += doc.num_pages
                report.cached += doc.num_pages
                report.unchanged_files += 1
                log.info("ingested %s: %d pages, 0 encoded, %d cached in %.2f s (unchanged file)", path,
                         doc.num_pages, doc.num_pages, time.perf_counter() - started)
                return
            # Count into a scratch report first: a file that fails half-way must not count its pages.
            scratch = IngestReport()
            points: list = []
            figures: list[_Figure] = []
            texts: dict[int, str] = {}  # each page's text: a figure is named on any page of its document
            lease = FileLease(self._new_lease(), renew_s=INGEST_LEASE_S / 4)
            try:
                for batch in batches(_between(doc.pages(), on_batch, scratch), self.vision_batch_size,
                                     self.documents.max_image_pixels):
                    page_points, batch_figures = self._process_batch(doc, batch, scratch, lease)
                    points.extend(page_points)
                    figures.extend(batch_figures)
                    texts.update((p.page, p.text) for p in batch)
                    if on_batch:
                        on_batch(scratch.pages)
                points.extend(self._figure_points(figures, texts, scratch))
                lease.check()
                t0 = time.perf_counter()
                self.index.replace_document(doc.doc_id, points)
                scratch.stage_seconds["index"] += time.perf_counter() - t0
            finally:
                lease.end()  # indexed now (or failed: its entries are garbage again)
        _merge(report, scratch)
        log.info("ingested %s: %d pages, %d encoded, %d cached, %d figures (%d encoded) in %.2f s", path,
                 scratch.pages, scratch.encoded, scratch.cached, scratch.figures, scratch.figures_encoded,
                 time.perf_counter() - started)

    def _is_current(self, doc: Document) -> bool:
        have = self.index.doc_pages(doc.doc_id)
        if len(have) != doc.num_pages or [p.page for p in have] != list(range(1, doc.num_pages + 1)):
            return False
        if any(p.file_sha256 != doc.file_sha256 or p.fingerprint != self.fingerprint for p in have):
            return False
        return all(self.store.contains(k) for p in have for key in p.image_keys for k in self._tier_keys(key))

    def _tier_keys(self, key: ImageKey) -> list[ImageKey]:
        # Each tier's key is its encoder's: the key names the encoder whose tokens it holds.
        return [key, *(e.key_for(key.content_hash) for e in self.tier_encoders)]

    def _process_batch(self, doc: Document, pages: list[RenderedPage], report: IngestReport, lease: FileLease
                       ) -> tuple[list, list[_Figure]]:
        """The batch's page points, and its figures for _figure_points (at the document's end)."""
        keys = [self.encoder.key_for(p.content_hash) for p in pages]
        crops = [c for p in pages for c in p.figures]
        crop_keys = [self.encoder.key_for(c.content_hash) for c in crops]
        tiers = [(e, [e.key_for(p.content_hash) for p in pages], [e.key_for(c.content_hash) for c in crops])
                 for e in self.tier_encoders]
        absent = lease.take({*keys, *crop_keys, *(k for _, a, b in tiers for k in (*a, *b))})
        encoded, cached = self._encode_missing(self.encoder, [p.image for p in pages], keys, absent, report)
        report.encoded, report.cached = report.encoded + encoded, report.cached + cached
        encoded, _ = self._encode_missing(self.encoder, [c.image for c in crops], crop_keys, absent, report)
        report.figures_encoded += encoded
        for encoder, page_keys, tier_crop_keys in tiers:
            encoded, cached = self._encode_missing(encoder, [p.image for p in pages], page_keys, absent, report)
            report.encoded, report.cached = report.encoded + encoded, report.cached + cached
            encoded, _ = self._encode_missing(encoder, [c.image for c in crops], tier_crop_keys, absent, report)
            report.figures_encoded += encoded
        in_order = iter(crop_keys)  # crops are the pages' figures in page order
        figures = [tuple(PageFigure(c.region, next(in_order), self.encoder.num_tokens_for(c.image))
                         for c in p.figures) for p in pages]
        captions = [find_page_captions(p) for p in pages]
        vectors = self._embed(pages, captions, report)
        for p in pages:
            report.pages += 1
            report.figures += len(p.figures)
            report.ocr_pages += p.text_source is TextSource.OCR
            if p.figures_skipped:
                report.figures_skipped.append({"doc": p.doc, "page": p.page, "why": p.figures_skipped})
            for stage, secs in p.timings.items():
                report.stage_seconds[stage] += secs
        payloads = [self._payload(doc, p, key, caps, figs) for p, key, caps, figs in zip(pages, keys, captions, figures)]
        return ([make_point(vecs, payload) for vecs, payload in zip(vectors, payloads)],
                self._figures(pages, payloads, report))

    def _figures(self, pages: list[RenderedPage], payloads: list[PagePayload], report: IngestReport
                 ) -> list[_Figure]:
        """Each figure of the batch with its crop's image vectors where the page-image channel is configured (CLIP,
        or the late retriever's pooled multi-vector and mean: then an uncaptioned chart on a slide is found by its
        pixels), made now while the crops are in memory; its text waits for the document's end."""
        crops = [(payload, i, page.figures[i]) for page, payload in zip(pages, payloads)
                 for i in range(len(payload.figures))]
        found = [_Figure(payload, i, crop.words) for payload, i, crop in crops]
        if found and (self.image_embedder is not None or self.late is not None):
            t0 = time.perf_counter()
            self._image_vectors([crop.image for _, _, crop in crops], [f.vectors for f in found])
            report.stage_seconds["embed"] += time.perf_counter() - t0
        return found

    def _figure_points(self, figures: list[_Figure], texts: dict[int, str], report: IngestReport) -> list:
        """A point per figure that can be found: its page's payload with which figure it is (mmrag/core/payload.py
        figure_payload), the dense vector of its text where it has any (its caption, the words drawn in it, the
        sentences naming it on any page of the document: mmrag.core.figures.figure_text), its image vectors where
        they were made (_figures)."""
        mentions = figure_mentions(sorted(texts.items()))
        rows = []
        for f in figures:
            region, page = f.region, f.payload.page
            elsewhere = [s for on, s in mentions.get(region.ref, []) if on != page] if region.ref else []
            rows.append((f, figure_text(region, texts.get(page, ""), words=f.words, elsewhere=elsewhere)))
        rows = [(f, text) for f, text in rows if text or f.vectors]
        with_text = [(f, text) for f, text in rows if text]
        if with_text:
            t0 = time.perf_counter()
            for (f, _), vec in zip(with_text, self.text_embedder.embed([text for _, text in with_text])):
                f.vectors[TEXT_VECTOR] = vec.tolist()
            report.stage_seconds["embed"] += time.perf_counter() - t0
        return [make_point(f.vectors, f.payload, figure=f.index) for f, _ in rows]

    def _encode_missing(self, encoder: VisionEncoder, images: list[Image.Image], keys: list[ImageKey],
                        absent: set[ImageKey], report: IngestReport) -> tuple[int, int]:
        """Encode and store the images whose key is ``absent`` (what the lease found unstored), one forward per
        distinct key, so a figure repeated within the batch is encoded once. Returns (forwards, images whose
        tokens were stored already or encoded for an earlier image of the batch)."""
        missing: dict[ImageKey, Image.Image] = {}
        for image, key in zip(images, keys):
            if key not in missing:
                self.store.stats.record_lookup(hit=key not in absent)  # counted as a lookup, as `contains` does
                if key in absent:
                    missing[key] = image
        if not missing:
            return 0, len(images)
        t0 = time.perf_counter()
        encoded = encoder.encode(list(missing.values()))
        writer = ScopedFeatureStore(self.store, EncoderScope(encoder.version, encoder.policy))  # its keys only
        for key, value in zip(missing, encoded):
            writer.put(key, value)
        report.stage_seconds["encode"] += time.perf_counter() - t0
        # The pixels form without tokens (MMRAG_INGEST_IMAGE_TOKENS=false) stores pixels and a grid: no forward.
        return sum(value.has_tokens for value in encoded), len(images) - len(missing)

    def _embed(self, pages: list[RenderedPage], captions: list[list[Caption]], report: IngestReport
               ) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        vectors: list[dict[str, Any]] = [{} for _ in pages]
        with_text = [i for i, p in enumerate(pages) if p.text.strip()]
        # A page without text gets no text vectors (Qdrant allows a missing named vector): an embedding of
        # the empty string would match every query equally. The dense vector reads the captions first: MiniLM
        # reads 256 word pieces, so a caption low on a long page would otherwise not be read at all.
        dense = [" ".join([*(c.text for c in captions[i]), pages[i].text]) for i in with_text]
        for i, vec in zip(with_text, self.text_embedder.embed(dense)):
            vectors[i][TEXT_VECTOR] = vec.tolist()
        for i in with_text:
            indices, values = self.lexical.document(pages[i].text, captions[i])
            if indices:
                vectors[i][LEXICAL_VECTOR] = (indices, values)  # sparse: make_point makes it Qdrant's
        self._image_vectors([p.image for p in pages], vectors)
        report.stage_seconds["embed"] += time.perf_counter() - t0
        return vectors

    def _image_vectors(self, images: list[Image.Image], into: list[dict[str, Any]]) -> None:
        """The page-image channel's vectors of ``images`` (pages, or figure crops) into the matching dicts:
        CLIP's, or the late retriever's multi-vector pooled to 1/late_pool_factor of its rows and its mean."""
        if self.image_embedder is not None:
            for vectors, vec in zip(into, self.image_embedder.embed(images)):
                vectors[IMAGE_VECTOR] = vec.tolist()
        if self.late is not None:
            for vectors, multi in zip(into, self.late.embed_pages(images)):
                vectors[PAGE_VECTOR] = pool_tokens(multi, self.late_pool_factor).tolist()
                vectors[PAGE_MEAN_VECTOR] = mean_pool(multi).tolist()

    def _payload(self, doc: Document, page: RenderedPage, key: ImageKey, captions: list[Caption],
                 figures: tuple[PageFigure, ...]) -> PagePayload:
        return PagePayload(
            doc_id=doc.doc_id,
            doc=doc.doc,
            path=doc.path,
            page=page.page,
            num_pages=doc.num_pages,
            file_sha256=doc.file_sha256,
            content_hash=page.content_hash,
            image_key=key,
            image_tokens=self.encoder.num_tokens_for(page.image),
            width=page.image.width,
            height=page.image.height,
            text=page.text,
            text_source=page.text_source,
            fingerprint=self.fingerprint,
            captions=tuple(c.text for c in captions),
            figures=figures,
        )


@dataclass(slots=True)
class _Figure:
    """A figure of a document being ingested, until its point is made at the document's end."""

    payload: PagePayload  # its page's
    index: int  # which of the page's figures
    words: str  # drawn inside it (FigureCrop.words)
    vectors: dict[str, Any] = field(default_factory=dict)  # its image vectors, where made; then its text's

    @property
    def region(self) -> FigureRegion:
        return self.payload.figures[self.index].region


class FileLease:
    """One file's lease on its pages' keys (mmrag.core.keys.KeyLease), from before the store is asked for them until the
    file's pages are indexed; its earlier keys renewed every ``renew_s`` seconds while later batches run."""

    def __init__(self, lease: KeyLease, *, renew_s: float) -> None:
        self._lease = lease
        self._renew_s = renew_s
        self._renewed = time.monotonic()
        self.held: set[ImageKey] = set()

    def take(self, keys: set[ImageKey]) -> set[ImageKey]:
        """Lease ``keys``; those the store lacks (to encode and store now, under the lease)."""
        renew = time.monotonic() - self._renewed > self._renew_s
        if renew:
            self._renewed = time.monotonic()
        absent = self._take(keys | self.held if renew else keys)
        self._lost(absent & self.held)
        self.held |= keys
        return absent

    def check(self) -> None:
        """Renew every key, and fail the file if one of them was deleted after all: its pages must not be indexed
        without their tokens."""
        self._lost(self._take(self.held))

    def _take(self, keys: set[ImageKey]) -> set[ImageKey]:
        try:
            return self._lease.take(keys)
        except OSError as exc:  # a disk store's lease is a file: it fails this file, as a write there would
            raise FeatureStoreError(f"cannot lease this file's image-token entries ({exc.strerror}): free space "
                                    "on the feature store's disk (or make it writable), then ingest again") from exc

    def end(self) -> None:
        self._lease.end()

    def _lost(self, keys: set[ImageKey]) -> None:
        if keys:
            raise FeatureStoreError(
                f"{len(keys)} image-token entries of this file were deleted while it was ingested (e.g. {min(keys)}), "
                f"so its pages are not indexed: its lease ran out or a deletion raced it; ingest the file again")


def missing_keys(store: FeatureStore, images: list[Image.Image], keys: list[ImageKey]
                 ) -> tuple[dict[ImageKey, Image.Image], int]:
    """The keys the store lacks, each with one image to encode it from, and how many images need no forward:
    one forward per distinct missing key, so a figure repeated within the batch is encoded once."""
    missing: dict[ImageKey, Image.Image] = {}
    cached = 0
    for image, key in zip(images, keys):
        if key in missing or store.contains(key):
            cached += 1
        else:
            missing[key] = image
    return missing, cached


# A page that looks like a slide (landscape, little text): its first line is its title, a caption of the page.
SLIDE_MAX_WORDS = 150


def find_page_captions(page: RenderedPage) -> list[Caption]:
    """The page's caption lines (mmrag/core/figures.py captions): figures, tables, listings and, on a slide, its title."""
    slide = page.image.width > page.image.height and len(page.text.split()) <= SLIDE_MAX_WORDS
    return find_captions(page.text, slide=slide)


def encoder_fingerprint(scope: EncoderScope) -> str:
    """A page fingerprint's leading parts: the encoder and policy that made its tokens. `mmrag reencode`
    rewrites exactly these (ingestion/reencode.py), so a re-encoded page is current for `mmrag ingest`."""
    return f"enc={scope.version}|{scope.policy}"


def _between(pages: Iterator[RenderedPage], on_page: Callable[[int], None] | None, report: IngestReport
             ) -> Iterator[RenderedPage]:
    """``pages``, with ``on_page(pages indexed so far)`` called before each page after the first is loaded (its
    render, text, OCR and figures: seconds for a heavy page), as after each batch: a job's progress callback,
    which stops a cancelled job and runs other tenants' queued jobs there, so neither waits for a whole batch."""
    for n, page in enumerate(pages):
        if n and on_page:
            on_page(report.pages)
        yield page


def batches(pages: Iterator[RenderedPage], size: int, max_pixels: int | None = None
            ) -> Iterator[list[RenderedPage]]:
    """``pages`` in batches of ``size``, each holding at most ``max_pixels`` decoded pixels (a page over it
    alone: a batch of its own), so the pages held at once are bounded by their pixels, not only their count:
    eight 7000x7000 frames of a TIFF are encoded one by one (~150 MB each), not together (1.2 GB)."""
    batch: list[RenderedPage] = []
    pixels = 0
    for page in pages:
        n = page.image.width * page.image.height
        if batch and max_pixels is not None and pixels + n > max_pixels:
            yield batch
            batch, pixels = [], 0
        batch.append(page)
        pixels += n
        if len(batch) == size:
            yield batch
            batch, pixels = [], 0
    if batch:
        yield batch


def _merge(into: IngestReport, part: IngestReport) -> None:
    into.pages += part.pages
    into.encoded += part.encoded
    into.cached += part.cached
    into.figures += part.figures
    into.figures_encoded += part.figures_encoded
    into.ocr_pages += part.ocr_pages
    into.figures_skipped += part.figures_skipped
    for stage, secs in part.stage_seconds.items():
        into.stage_seconds[stage] += secs


def unexpected(exc: Exception) -> str:
    """A file's failure that mmrag did not foresee, as the report lists it: what was raised, and what to do."""
    return (f"unexpected {type(exc).__name__} ({exc}): the file's other pages are not indexed; the other files "
            "are. Run with MMRAG_LOG_LEVEL=DEBUG for the traceback and report it with the file")
