"""Find source files and open them as validated documents that render page by page.

Everything a user can get wrong about an input file (empty, truncated, encrypted, too many pages, a
decompression bomb, a lying extension, no tesseract) is checked in :func:`open_document`, before any
page is rendered, and raised as :class:`IngestError` with the fix in the message; so is any OSError on the
path (a name too long for the file system, no permission). Messages do not repeat the path: the pipeline
pairs them with it in a :class:`FileFailure`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c
from PIL import Image, ImageOps

from mmrag.adapters.lexical import known_words
from mmrag.core.keys import ContentHash, content_hash_of, doc_id_for
from mmrag.core.figures import figure_words
from mmrag.core.pages import FigureCrop, RenderedPage, TextSource
from mmrag.core.settings import DocumentSettings
from mmrag.core.text import normalise
from ingestion import ocr
from ingestion.figures import FigureBudgetError, crop_figures, detect_figures, words_inside
from ingestion.raster import MAX_ASPECT, fit_aspect, fitted_size

logger = logging.getLogger(__name__)

# Suffix -> the format its content must have (Pillow's format names; "PDF" for pdfium).
SUPPORTED_FORMATS: dict[str, str] = {
    ".pdf": "PDF",
    ".png": "PNG",
    ".jpg": "JPEG",
    ".jpeg": "JPEG",
    ".webp": "WEBP",
    ".tif": "TIFF",
    ".tiff": "TIFF",
}
_SUFFIX_FOR = {"PDF": ".pdf", "PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "TIFF": ".tiff"}
_SUPPORTED_LIST = "PDF, PNG, JPEG, WebP, TIFF"

# Fewer non-space characters than this in a PDF's text layer (a page number, a stray label) means the
# page is really a scan or a figure, so OCR is worth running on it.
MIN_TEXT_CHARS = 20

# What Pillow 13's PNG/JPEG/WebP/TIFF readers raise for damaged files, collected by fuzzing them with
# flipped and truncated bytes (TIFF alone produced KeyError, TypeError and SyntaxError). Caught only around
# open/seek/load/transpose of an untrusted file, never around our own code.
_PIL_DECODE_ERRORS = (OSError, SyntaxError, ValueError, TypeError, KeyError, EOFError, struct.error)


@dataclass(slots=True, frozen=True)
class FileFailure:
    """A path that was not ingested, and why (an :class:`IngestError` message)."""

    path: str
    error: str

    @classmethod
    def of(cls, path: Path, error: str) -> FileFailure:
        # A name that is not UTF-8 comes back from the OS with surrogate escapes, which no JSON can carry:
        # its undecodable bytes are shown as U+FFFD.
        return cls(os.fsencode(path).decode("utf-8", "replace"), error)


class IngestError(Exception):
    """A source file that cannot be ingested; the message says what to do about it."""


class ImageTooLargeError(IngestError):
    """An image over a size limit (MMRAG_MAX_IMAGE_BYTES, MMRAG_MAX_IMAGE_PIXELS, Pillow's own bomb limit): the
    services answer it with 413, other decoding failures with 400; the message names the limit."""


# --- discovery ---------------------------------------------------------------------------------------


def discover(paths: list[Path], *, recursive: bool, root: Path | None = None
             ) -> tuple[list[Path], list[FileFailure]]:
    """Expand CLI PATH arguments into the files to ingest, plus failures for paths that cannot be.

    Files are kept as given; a directory contributes its supported files, sorted (its whole tree with
    ``recursive``, otherwise its top level, ignoring subdirectories). Argument order is kept and a file
    reached twice (two arguments, a symlink) is listed once. A symbolic link found in a folder that leads
    nowhere (dangling, or a loop), a path the file system refuses (too long) and a name that is not UTF-8
    are failed files, never silently dropped, and never fail the rest. With ``root`` (server-side ingest),
    every file must resolve inside it: a link found while walking cannot reach a file outside the root.
    """
    files: list[Path] = []
    failures: list[FileFailure] = []
    seen: set[Path] = set()
    root = root.resolve() if root is not None else None
    for arg in paths:
        try:
            if arg.is_dir():
                candidates, unusable = _files_in(arg, recursive)
                failures += unusable
            elif arg.is_file():
                candidates = [arg]
            else:
                failures.append(FileFailure.of(arg, _not_a_file_message(arg)))
                continue
        except OSError as exc:  # a name or path too long for the file system, a folder it does not let us list
            failures.append(FileFailure.of(arg, os_error_message(exc)))
            continue
        for path in candidates:
            if not _is_utf8(path):
                failures.append(FileFailure.of(path, "the file name is not UTF-8 text: rename it (`convmv` converts "
                                                     "names from another encoding)"))
                continue
            resolved = path.resolve()
            if root is not None and not resolved.is_relative_to(root):
                failures.append(FileFailure.of(path, "is a link to a file outside the ingest root: copy the file "
                                                     "under MMRAG_INGEST_ROOT to ingest it"))
                continue
            if resolved in seen:
                continue
            seen.add(resolved)
            if _format_for(path) is not None:
                files.append(path)
            elif path is arg or path.suffix.lower() in CONVERTIBLE_DOCUMENTS:
                # A file named on the command line, or an office document found in a folder of reports, is
                # most likely something the user expects to be searchable: leaving it out silently would make
                # answers quietly incomplete. Other files in a folder (manifest.json, notes.txt, .csv) are
                # not documents and are passed over.
                failures.append(FileFailure.of(path, unsupported_message(path)))
    return files, failures


# Document formats people keep beside PDFs; found in a folder, they are reported rather than passed over.
CONVERTIBLE_DOCUMENTS = frozenset(
    {".doc", ".docx", ".odt", ".rtf", ".ppt", ".pptx", ".odp", ".key", ".pages", ".xls", ".xlsx", ".ods",
     ".epub", ".djvu", ".bmp", ".gif", ".heic", ".svg", ".eps", ".ps", ".xps"}
)


def unsupported_message(path: Path) -> str:
    kind = path.suffix.lower() or "(no extension)"
    return f"unsupported file type {kind}: convert it to PDF or an image ({_SUPPORTED_LIST})"


def _files_in(directory: Path, recursive: bool) -> tuple[list[Path], list[FileFailure]]:
    """(regular files, failures) under ``directory``: links that lead nowhere, entries the OS refuses to
    look at (a path over PATH_MAX), subfolders it refuses to list.

    Hidden files and directories (.DS_Store, .git, the .mmrag data dir) are never documents, so they are
    skipped without a word. Subdirectories are simply not descended into without `recursive`, and os.walk
    does not follow directory symlinks, so a link loop cannot trap it.
    """
    failures: list[FileFailure] = []

    def unlisted(exc: OSError) -> None:
        failures.append(FileFailure.of(Path(exc.filename), os_error_message(exc)))

    if recursive:
        entries: list[Path] = []
        for root, dirs, names in os.walk(directory, onerror=unlisted):
            dirs[:] = [d for d in dirs if not _hidden(d)]
            entries += [Path(root, n) for n in names if not _hidden(n)]
    else:
        entries = [p for p in directory.iterdir() if not _hidden(p.name)]
    files = []
    for path in sorted(entries):
        try:
            if path.is_file():
                files.append(path)
            elif path.is_symlink() and not path.exists():  # dangling, or a loop (ELOOP reads as "not there")
                failures.append(FileFailure.of(path, _not_a_file_message(path)))
        except OSError as exc:
            failures.append(FileFailure.of(path, os_error_message(exc)))
    return files, failures


def _is_utf8(path: Path) -> bool:
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes of the name, surrogate-escaped by the OS layer
        return False
    return True


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _not_a_file_message(path: Path) -> str:
    if path.is_dir():
        return "is a directory, not a document file: pass it as a PATH argument so its files are discovered"
    if path.is_symlink():
        return ("broken symbolic link: its target does not exist or it loops back on itself; fix the link or "
                "pass the target")
    if path.exists():
        return "not a regular file or directory: pass a document file or a folder of them"
    return "no such file or directory: check the path"


def os_error_message(exc: OSError) -> str:
    """What an OSError on a source path means to its owner; without the path, which the failure carries."""
    if exc.errno == errno.ENAMETOOLONG:
        return ("the path is too long for the file system (a name over 255 bytes, or a whole path over 4096): "
                "rename it, or move it to a shallower folder")
    return f"cannot read it ({exc.strerror}): check its permissions"


def _format_for(path: Path) -> str | None:
    return SUPPORTED_FORMATS.get(path.suffix.lower())


# --- opening and validation --------------------------------------------------------------------------


def check_ocr(config: DocumentSettings) -> None:
    """Raise IngestError unless OCR is off or tesseract and its language data are installed.

    open_document calls this once per document; the pipeline may also call it once per run to fail
    before walking a large corpus.
    """
    if not config.ocr:
        return
    if not ocr.ocr_available():
        raise IngestError(
            "tesseract is not installed: apt-get install tesseract-ocr tesseract-ocr-eng, or set MMRAG_OCR=false"
        )
    try:
        missing = ocr.missing_languages(config.ocr_lang)
    except ocr.OcrError as exc:
        raise IngestError(f"tesseract does not work ({exc}): reinstall tesseract-ocr, or set MMRAG_OCR=false") from exc
    if missing:
        packages = " ".join(f"tesseract-ocr-{code.lower()}" for code in missing)
        raise IngestError(
            f"tesseract has no language data for {'+'.join(missing)}: apt-get install {packages}, "
            f"or set MMRAG_OCR_LANG to an installed language (`tesseract --list-langs`)"
        )


def render_page(path: Path, number: int, config: DocumentSettings) -> RenderedPage | None:
    """Page ``number`` of the file at ``path`` as ingestion renders it, without OCR (its image is what is
    wanted): what the page-image route shows and on-demand tier encodes encode. None when the file has no such
    page; IngestError when it cannot be opened."""
    with open_document(path, replace(config, ocr=False)) as doc:
        return doc.page(number)


def open_document(path: Path, config: DocumentSettings) -> Document:
    """Validate ``path`` completely and open it; the returned Document must be closed (use ``with``)."""
    resolved = _existing_file(path)
    expected = _format_for(resolved)
    if expected is None:
        raise IngestError(unsupported_message(resolved))
    head = _read_head(resolved)
    _check_content_matches(resolved, head, expected)
    check_ocr(config)
    if expected == "PDF":
        return Document(resolved, _file_sha256(resolved), _open_pdf(resolved, config), config)
    data = _read_bytes(resolved)
    source = _open_image(data, expected, config)
    return Document(resolved, hashlib.sha256(data).hexdigest(), source, config)


def _existing_file(path: Path) -> Path:
    try:
        if not path.is_file():
            raise IngestError(_not_a_file_message(path))
        return path.resolve()
    except OSError as exc:
        raise IngestError(os_error_message(exc)) from exc


def _read_head(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            head = f.read(1024)
    except OSError as exc:
        raise IngestError(os_error_message(exc)) from exc
    if not head:
        raise IngestError("file is empty (0 bytes): re-export or re-download it")
    return head


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise IngestError(os_error_message(exc)) from exc


def _file_sha256(path: Path) -> str:
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise IngestError(os_error_message(exc)) from exc


def sniff_format(head: bytes) -> str | None:
    """The format the first bytes of a file announce, or None when they announce none we read."""
    # Image signatures sit at offset 0 and are checked first: a PNG may carry "%PDF-" in a text chunk.
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):  # classic and BigTIFF
        return "TIFF"
    if b"%PDF-" in head[:1024]:  # PDF readers, pdfium included, accept junk before the header
        return "PDF"
    return None


def _check_content_matches(path: Path, head: bytes, expected: str) -> None:
    actual = sniff_format(head)
    suffix = path.suffix.lower()
    if actual is None:
        what = "a PDF" if expected == "PDF" else f"a {expected} image"
        raise IngestError(
            f"the file is named {suffix} but is not {what} (unrecognised header): it is damaged or not "
            f"what its name says; re-export or re-download it"
        )
    if actual != expected:
        what = "a PDF" if actual == "PDF" else f"a {actual} image"
        raise IngestError(f"the file is named {suffix} but contains {what}: rename it to {_SUFFIX_FOR[actual]}")


# --- PDF ---------------------------------------------------------------------------------------------


# pdfium is not thread-safe, not even across documents (pypdfium2 says so), and one process uses it from several
# threads: ingest workers, the page-image route's renders, on-demand tier encodes. Two page images rendered at
# once crashed `mmrag serve` with SIGSEGV. Every pdfium call of this module (opening, a page's render, text and
# figures, closing) holds this lock; OCR, encoding and embedding run outside it.
PDFIUM_LOCK = threading.RLock()


def _open_pdf(path: Path, config: DocumentSettings) -> _PdfSource:
    with PDFIUM_LOCK:
        try:
            pdf = pdfium.PdfDocument(path)
        except pdfium.PdfiumError as exc:
            raise IngestError(_pdf_load_message(exc)) from exc
        with contextlib.ExitStack() as on_error:
            on_error.callback(pdf.close)
            _validate_pdf(pdf, config)
            # So that filled-in form fields appear in page images as they do in a viewer; pdfium wants this
            # before any page is loaded.
            pdf.init_forms()
            on_error.pop_all()  # valid: the source owns the handle from here on
    return _PdfSource(pdf, config.pdf_dpi, figures=config.figures, max_pixels=config.max_image_pixels,
                      ocr_lang=config.ocr_lang if config.ocr else None)


def _pdf_load_message(exc: pdfium.PdfiumError) -> str:
    if exc.err_code in (pdfium_c.FPDF_ERR_PASSWORD, pdfium_c.FPDF_ERR_SECURITY):
        return (
            "the PDF is encrypted / password-protected: remove the password, e.g. "
            "`qpdf --decrypt --password=PASSWORD in.pdf out.pdf`, and ingest out.pdf"
        )
    return (
        f"the PDF is corrupt or truncated ({exc}): re-export or re-download it; "
        "`qpdf --check` describes the damage and `qpdf in.pdf out.pdf` can often repair it"
    )


def _validate_pdf(pdf: pdfium.PdfDocument, config: DocumentSettings) -> None:
    num_pages = len(pdf)
    if num_pages == 0:
        raise IngestError("the PDF has no pages: re-export it")
    if num_pages > config.max_pdf_pages:
        raise IngestError(
            f"the PDF has {num_pages} pages, over the limit of {config.max_pdf_pages}: "
            "split it (e.g. `qpdf in.pdf --split-pages=100 out.pdf`) or raise MMRAG_MAX_PDF_PAGES"
        )
    # Page sizes come from the page tree without loading pages, so a huge page is refused before any
    # rendering starts rather than after the first hundred pages went through.
    for index in range(num_pages):
        try:
            size_pt = pdf.get_page_size(index)
        except pdfium.PdfiumError as exc:
            raise IngestError(_page_damaged_message(index + 1, exc)) from exc
        _check_page_pixels(size_pt, index + 1, config)


def _check_page_pixels(size_pt: tuple[float, float], number: int, config: DocumentSettings) -> None:
    width, height = (_pixels_at(v, config.pdf_dpi) for v in size_pt)
    if width < 1 or height < 1:
        raise IngestError(
            f"page {number} has no area ({size_pt[0]:g}x{size_pt[1]:g} pt): repair or re-export the PDF"
        )
    if width * height > config.max_image_pixels:
        raise IngestError(
            f"page {number} would render at {width}x{height} px ({width * height:,} pixels) at "
            f"{config.pdf_dpi} dpi, over the limit of {config.max_image_pixels:,}: lower MMRAG_PDF_DPI, "
            "or raise MMRAG_MAX_IMAGE_PIXELS if the PDF is trusted"
        )
    _check_fitted((width, height), f"page {number} at {config.pdf_dpi} dpi", config)


def _pixels_at(points: float, dpi: int) -> int:
    # The same arithmetic as pypdfium2's render(): ceil(points * scale) with scale = dpi / 72.
    return math.ceil(points * (dpi / 72))


class _PdfSource:
    """Renders pages of one open pdfium document; owns the handle until close()."""

    def __init__(self, pdf: pdfium.PdfDocument, dpi: int, *, figures: bool = False, max_pixels: int = 0,
                 ocr_lang: str | None = None) -> None:
        """``figures``: detect each page's figures and crop them (MMRAG_FIGURES); ``max_pixels``: the largest
        embedded picture decoded as it is (MMRAG_MAX_IMAGE_PIXELS); ``ocr_lang``: OCR a raster figure that holds
        no text objects in these languages (MMRAG_OCR_LANG; None: MMRAG_OCR is off)."""
        self._pdf = pdf
        self._dpi = dpi
        self._figures_on = figures
        self._max_pixels = max_pixels
        self._ocr_lang = ocr_lang
        self.num_pages = len(pdf)

    def raster(self, index: int) -> _Raster:
        with PDFIUM_LOCK:
            return self._raster(index)

    def _raster(self, index: int) -> _Raster:
        number = index + 1
        try:
            page = self._pdf[index]
        except pdfium.PdfiumError as exc:
            raise IngestError(_page_damaged_message(number, exc)) from exc
        # Child handles are closed before their parent (textpage, then page; the document in close()),
        # and before anything is yielded, so an abandoned iteration leaves nothing open but the document.
        try:
            started = time.perf_counter()
            image = self._render(page, number)
            rendered = time.perf_counter()
            textpage = self._textpage(page, number)
            try:
                text = self._text_layer(textpage)
                done = time.perf_counter()
                figures, skipped = self._figures(page, textpage, number) if self._figures_on else ([], "")
            finally:
                textpage.close()
        finally:
            page.close()
        timings = {"render": rendered - started, "text": done - rendered}
        if self._figures_on:
            timings["figures"] = time.perf_counter() - done
        return _Raster(image, text, self._dpi, timings, figures, skipped)

    def _render(self, page: pdfium.PdfPage, number: int) -> Image.Image:
        try:
            bitmap = page.render(scale=self._dpi / 72)
        except pdfium.PdfiumError as exc:
            raise IngestError(_page_damaged_message(number, exc)) from exc
        try:
            # An explicit copy: the bitmap's buffer is freed below, and whether to_pil() shares it
            # depends on the pixel format pdfium picked.
            return normalise_image(bitmap.to_pil().copy())
        finally:
            bitmap.close()

    @staticmethod
    def _textpage(page: pdfium.PdfPage, number: int) -> pdfium.PdfTextPage:
        try:
            return page.get_textpage()
        except pdfium.PdfiumError as exc:
            raise IngestError(_page_damaged_message(number, exc)) from exc

    @staticmethod
    def _text_layer(textpage: pdfium.PdfTextPage) -> str:
        return _normalised(textpage.get_text_range())

    def _figures(self, page: pdfium.PdfPage, textpage: pdfium.PdfTextPage,
                 number: int) -> tuple[list[FigureCrop], str]:
        """The page's figures, each cropped as an image of its own (ingestion/figures.py), and why none were
        looked for when the page is over the figure step's bounds (else "")."""
        try:
            crops = crop_figures(page, detect_figures(page, textpage=textpage), max_pixels=self._max_pixels,
                                 index=number - 1)
            return [self._with_words(page, textpage, crop, number) for crop in crops], ""
        except FigureBudgetError as exc:
            logger.warning("page %d: figures skipped (%s); its image and text are kept", number, exc)
            return [], str(exc)
        except pdfium.PdfiumError as exc:
            raise IngestError(_page_damaged_message(number, exc)) from exc

    def _with_words(self, page: pdfium.PdfPage, textpage: pdfium.PdfTextPage, crop: FigureCrop,
                    number: int) -> FigureCrop:
        """The crop with the words drawn inside it: the page's text objects in its region, normalised as the page's
        text is; a raster figure that holds none (a screenshot, a scanned chart) is read by OCR where MMRAG_OCR is
        on. A figure OCR cannot read keeps no words, with a warning: its page is ingested all the same."""
        raw = words_inside(page, textpage, crop.region.bbox_pt)
        if not raw.strip() and crop.region.source == "raster" and self._ocr_lang:
            try:
                raw = ocr.ocr_image(crop.image, self._ocr_lang)
            except ocr.OcrError as exc:
                logger.warning("page %d: the figure at %s was not read by OCR (%s); it is found by its caption and "
                               "pixels", number, crop.region.bbox_pt, exc)
        words = figure_words(_normalised(raw), crop.region.caption) if raw.strip() else ""
        return replace(crop, words=words)

    def close(self) -> None:
        with PDFIUM_LOCK:
            self._pdf.close()


def _normalised(raw: str) -> str:
    """Text read from a page (its text layer, a figure's text objects, OCR) as a page's text is kept: its own words
    and an English word list tell a joined hyphenation or a restored ligature from a real compound
    (mmrag/core/text.py, mmrag/adapters/lexical.py known_words)."""
    return normalise_text(raw, known=known_words(raw))


def _page_damaged_message(number: int, exc: Exception) -> str:
    return (
        f"page {number} cannot be read or rendered ({exc}): the PDF is damaged; "
        "repair it with `qpdf in.pdf out.pdf` or re-export it"
    )


# --- images ------------------------------------------------------------------------------------------


def _open_image(data: bytes, fmt: str, config: DocumentSettings) -> _ImageSource:
    """Check every frame's declared size from its header, then decode it fully, before accepting."""
    try:
        with Image.open(io.BytesIO(data), formats=[fmt]) as im:
            frames = _frame_count(im, fmt)
            if frames > config.max_pdf_pages:  # each frame is a page: the same bound as a PDF's, before decoding
                raise IngestError(
                    f"the {fmt} image has {frames} frames, each a page, over the limit of {config.max_pdf_pages} "
                    "pages a document may have: split it (e.g. `tiffsplit in.tif part-`) or raise "
                    "MMRAG_MAX_PDF_PAGES")
            for index in range(frames):
                im.seek(index)
                _check_image_pixels(im.size, config)  # header only: nothing decoded yet
                im.load()  # a full decode: truncation shows up here, not at open()
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(_pillow_bomb_message(config)) from exc
    except _PIL_DECODE_ERRORS as exc:
        raise IngestError(_image_damaged_message(fmt, exc)) from exc
    return _ImageSource(data, fmt, frames)


def _frame_count(im: Image.Image, fmt: str) -> int:
    # Only TIFF frames are pages (multi-page scans); an animated PNG/WebP is one picture, its first frame.
    return getattr(im, "n_frames", 1) if fmt == "TIFF" else 1


def _check_image_pixels(size: tuple[int, int], config: DocumentSettings) -> None:
    width, height = size
    if width * height > config.max_image_pixels:
        raise ImageTooLargeError(
            f"the image is {width}x{height} px ({width * height:,} pixels), over the limit of "
            f"{config.max_image_pixels:,}: downscale it, or raise MMRAG_MAX_IMAGE_PIXELS if the image is trusted"
        )
    _check_fitted(size, "the image", config)


def _check_fitted(size: tuple[int, int], what: str, config: DocumentSettings) -> None:
    """A raster whose aspect ratio the processor refuses is padded to one it takes (ingestion/raster.py): the
    padded raster must be within MMRAG_MAX_IMAGE_PIXELS too, checked before any pixel is made."""
    (width, height), (fw, fh) = size, fitted_size(*size)
    if fw * fh > config.max_image_pixels:
        raise ImageTooLargeError(
            f"{what} is {width}x{height} px, an aspect ratio over {MAX_ASPECT}:1, which the vision model takes only "
            f"padded to {fw}x{fh} px ({fw * fh:,} pixels), over the limit of {config.max_image_pixels:,}: cut it "
            "into parts of at most 200:1 each, or raise MMRAG_MAX_IMAGE_PIXELS if the file is trusted"
        )


def _pillow_bomb_message(config: DocumentSettings) -> str:
    # Pillow's own hard stop (2 x Image.MAX_IMAGE_PIXELS, ~179 MP) fires inside open()/seek(), before our
    # check sees the size. We read that global but never set it: it is process-wide, and other code in
    # the process (the feature store, the engine) relies on it too.
    pillow_cap = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    return (
        f"the image declares more than {pillow_cap:,} pixels, over Pillow's hard decompression-bomb limit, "
        f"which applies whatever MMRAG_MAX_IMAGE_PIXELS ({config.max_image_pixels:,}) says: downscale it"
    )


def _image_damaged_message(fmt: str, exc: Exception, number: int | None = None) -> str:
    where = f"frame {number} of the {fmt} image" if number else f"the {fmt} image"
    return (
        f"{where} cannot be decoded ({type(exc).__name__}: {exc}): it is damaged or truncated; "
        "re-export or re-download it"
    )


def decode_image(data: bytes, config: DocumentSettings) -> Image.Image:
    """Image bytes from an untrusted caller (an upload to the vision service, an image in a question) as the
    normalised picture ingestion would make of the same file: its first frame, upright, RGB over white.

    The same defences as ingesting an image file (a format read from the bytes, never from a name; every
    frame's pixels bounded by MMRAG_MAX_IMAGE_PIXELS before decoding; a full decode), plus a bound on the
    bytes themselves; so :func:`image_content_hash` of the result is the hash ingestion gives that file's page.
    Raises :class:`ImageTooLargeError` over a limit and :class:`IngestError` for anything else undecodable.
    """
    return _open_image(data, _image_format(data, config), config).raster(0).image


def image_header_size(data: bytes, config: DocumentSettings) -> tuple[int, int]:
    """The (width, height) that decoding ``data`` with :func:`decode_image` will hold at once, read from the image's
    header alone: no pixel is decoded, so a request's images can be admitted by their pixels before any is.

    The same checks as :func:`decode_image` short of decoding (bytes, format, every frame's declared pixels
    against MMRAG_MAX_IMAGE_PIXELS, Pillow's bomb limit); the size of the largest frame, since decoding checks
    every frame of a multi-page TIFF one after another (for other formats, the image's size). A damaged body is
    found only by decoding it.
    """
    fmt = _image_format(data, config)
    try:
        with Image.open(io.BytesIO(data), formats=[fmt]) as im:
            sizes = []
            for index in range(_frame_count(im, fmt)):
                im.seek(index)
                _check_image_pixels(im.size, config)
                sizes.append(im.size)
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(_pillow_bomb_message(config)) from exc
    except _PIL_DECODE_ERRORS as exc:
        raise IngestError(_image_damaged_message(fmt, exc)) from exc
    return max(sizes, key=lambda size: size[0] * size[1])


def _image_format(data: bytes, config: DocumentSettings) -> str:
    """The image format of untrusted bytes, read from them; over MMRAG_MAX_IMAGE_BYTES, empty, or no image
    format mmrag reads is refused with the fix."""
    if len(data) > config.max_image_bytes:
        raise ImageTooLargeError(
            f"the image is {len(data):,} bytes, over the limit of {config.max_image_bytes:,}: downscale or "
            "recompress it, or raise MMRAG_MAX_IMAGE_BYTES"
        )
    if not data:
        raise IngestError("the image is empty (0 bytes): send the file's bytes")
    fmt = sniff_format(data[:1024])
    if fmt is None or fmt == "PDF":
        what = "a PDF" if fmt == "PDF" else "no image format mmrag reads (unrecognised header)"
        raise IngestError(f"the bytes are {what}: send a PNG, JPEG, WebP or TIFF image (PNG for rendered pages, "
                          "which it keeps lossless)")
    return fmt


def image_content_hash(image: Image.Image) -> ContentHash:
    """The content hash of a normalised image (:func:`normalise_image`): what its ImageKey is made of."""
    return content_hash_of(image.mode, image.size, image.tobytes())


class _ImageSource:
    """Decodes frames of an image already validated and held in memory (so its bytes match file_sha256)."""

    def __init__(self, data: bytes, fmt: str, frames: int) -> None:
        self._data = data
        self._fmt = fmt
        self.num_pages = frames

    def raster(self, index: int) -> _Raster:
        started = time.perf_counter()
        try:
            with Image.open(io.BytesIO(self._data), formats=[self._fmt]) as im:
                im.seek(index)
                dpi = _image_dpi(im)
                # Photos of documents carry their rotation in EXIF; the model should see them upright.
                image = normalise_image(ImageOps.exif_transpose(im))
        except _PIL_DECODE_ERRORS as exc:
            raise IngestError(_image_damaged_message(self._fmt, exc, index + 1)) from exc
        return _Raster(image, None, dpi, {"render": time.perf_counter() - started})

    def close(self) -> None:
        self._data = b""


def _image_dpi(im: Image.Image) -> float | None:
    dpi = im.info.get("dpi")
    if not dpi or not dpi[0] or dpi[0] < 1:
        return None
    return float(dpi[0])


# --- normalisation -----------------------------------------------------------------------------------


_WHITE = (255, 255, 255, 255)


def normalise_image(img: Image.Image) -> Image.Image:
    """RGB, with any transparency composited over white, so one picture always has one content hash; an aspect
    ratio the vision processor refuses fitted (ingestion/raster.py)."""
    if img.has_transparency_data:
        rgba = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    return fit_aspect(img if img.mode == "RGB" else img.convert("RGB"))


def normalise_text(text: str, *, known: Callable[[str], bool] | None = None) -> str:
    """Single spaces within lines, one newline between non-empty lines, no control characters, ligatures and
    hyphenation resolved: :func:`mmrag.core.text.normalise`, the one normaliser (questions go through it too).

    The same words then embed the same whether they came from a text layer (CRLF, tabs, pdfium's U+FFFE
    hyphenation marks) or tesseract (trailing form feed, blank lines, line-end hyphens). ``known`` (e.g.
    ``mmrag.adapters.lexical.known_words(text)``) lets it restore dropped ligatures and decide line-end hyphens
    with a dictionary.
    """
    return normalise(text, known=known)


def has_meaningful_text(text: str) -> bool:
    return sum(not c.isspace() for c in text) >= MIN_TEXT_CHARS


# --- the document ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Raster:
    """A page as its source produced it, before text decisions and hashing."""

    image: Image.Image  # normalised RGB
    text_layer: str | None  # None: the source has no text layer (images)
    dpi: float | None
    timings: dict[str, float] = field(default_factory=dict)
    figures: list[FigureCrop] = field(default_factory=list)
    figures_skipped: str = ""  # why the figure step skipped the page (ingestion/figures.FigureBudgetError)


class _PageSource(Protocol):
    num_pages: int

    def raster(self, index: int) -> _Raster: ...

    def close(self) -> None: ...


class Document:
    """An opened, validated source file; ``pages()`` renders one page at a time.

    Holds a pdfium handle for PDFs: use it as a context manager, from one thread at a time. Documents may be open
    in several threads at once: their pdfium calls take turns (PDFIUM_LOCK).
    """

    def __init__(self, path: Path, file_sha256: str, source: _PageSource, config: DocumentSettings) -> None:
        self.path = str(path)
        self.doc = path.name
        self.doc_id = doc_id_for(self.path)
        self.file_sha256 = file_sha256
        self.num_pages = source.num_pages
        self._source = source
        self._ocr = config.ocr
        self._ocr_lang = config.ocr_lang
        self._closed = False

    def pages(self) -> Iterator[RenderedPage]:
        for index in range(self.num_pages):
            if self._closed:
                raise ValueError(f"{self.doc}: pages() used after the Document was closed")
            yield self._page(index)

    def page(self, number: int) -> RenderedPage | None:
        """Page ``number`` (1-based) alone, none before it rendered; None when the document has fewer pages."""
        if self._closed:
            raise ValueError(f"{self.doc}: page() used after the Document was closed")
        return self._page(number - 1) if 1 <= number <= self.num_pages else None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._source.close()

    def __enter__(self) -> Document:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Document({self.doc!r}, pages={self.num_pages}, doc_id={self.doc_id})"

    def _page(self, index: int) -> RenderedPage:
        raster = self._source.raster(index)
        timings = dict(raster.timings)
        text, source = self._text_for(raster, index + 1, timings)
        image = raster.image
        return RenderedPage(
            doc_id=self.doc_id,
            doc=self.doc,
            path=self.path,
            page=index + 1,
            image=image,
            content_hash=image_content_hash(image),
            text=text,
            text_source=source,
            timings=timings,
            figures=raster.figures,
            figures_skipped=raster.figures_skipped,
        )

    def _text_for(self, raster: _Raster, number: int, timings: dict[str, float]) -> tuple[str, TextSource]:
        layer = raster.text_layer or ""
        if has_meaningful_text(layer):
            return layer, TextSource.TEXT_LAYER
        if self._ocr:
            started = time.perf_counter()
            text = self._run_ocr(raster, number)
            timings["ocr"] = time.perf_counter() - started
            if text:
                return text, TextSource.OCR
        # OCR off or empty: a short text layer (a caption, a page number) is still better than nothing.
        return (layer, TextSource.TEXT_LAYER) if layer else ("", TextSource.NONE)

    def _run_ocr(self, raster: _Raster, number: int) -> str:
        try:
            return _normalised(ocr.ocr_image(raster.image, self._ocr_lang, dpi=raster.dpi))
        except ocr.OcrError as exc:
            raise IngestError(
                f"OCR failed on page {number} ({exc}): check the tesseract install, or set MMRAG_OCR=false"
            ) from exc
