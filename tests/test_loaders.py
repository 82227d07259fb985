"""Loading source files: discovery, up-front validation with fixes in the messages, rendering and text.

Every input is built in tmp_path with the real libraries: PDFs with a text layer from matplotlib
(fonttype 42 embeds real glyphs with a ToUnicode map), image-only PDFs from Pillow, encrypted PDFs with
qpdf. OCR runs the real tesseract and is skipped, with the reason, where it is not installed.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import struct
import subprocess
import zlib
from pathlib import Path

import matplotlib
import pytest
from PIL import Image, ImageDraw, ImageFont

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_pdf import PdfPages  # noqa: E402

from mmrag.core.keys import doc_id_for  # noqa: E402
from mmrag.core.pages import TextSource  # noqa: E402
from mmrag.core.settings import DocumentSettings, Settings  # noqa: E402
from ingestion import ocr  # noqa: E402
from ingestion.loaders import (  # noqa: E402
    FileFailure,
    IngestError,
    discover,
    normalise_text,
    open_document,
    render_page,
)

needs_tesseract = pytest.mark.skipif(
    not ocr.ocr_available(), reason="tesseract is not installed (apt-get install tesseract-ocr tesseract-ocr-eng)"
)
needs_qpdf = pytest.mark.skipif(shutil.which("qpdf") is None, reason="qpdf is not installed (apt-get install qpdf)")

CAPTION = "Quarterly revenue grew twelve percent"


# --- builders ----------------------------------------------------------------------------------------


def settings(**overrides) -> DocumentSettings:
    """Explicit values for everything the loaders read, so MMRAG_* variables in the shell cannot leak in."""
    values = {"pdf_dpi": 96, "max_pdf_pages": 500, "max_image_pixels": 50_000_000, "ocr": False, "ocr_lang": "eng"}
    return Settings(**{**values, **overrides}).documents


def text_pdf(path: Path, lines: list[str]) -> Path:
    """One page per line, each with a real text layer."""
    with plt.rc_context({"pdf.fonttype": 42}), PdfPages(path) as pdf:
        for line in lines:
            fig = plt.figure(figsize=(4, 3))
            fig.text(0.05, 0.5, line, fontsize=10)
            pdf.savefig(fig)
            plt.close(fig)
    return path


def figure(text: str = CAPTION, size: tuple[int, int] = (640, 200), colour: str = "navy") -> Image.Image:
    """A deterministic picture with large printed text (large enough for tesseract at 96 dpi)."""
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle([10, 10, size[0] - 10, size[1] - 10], outline=colour, width=4)
    draw.text((30, size[1] // 2 - 20), text, fill="black", font=ImageFont.load_default(size=32))
    return img


def image_pdf(path: Path, img: Image.Image) -> Path:
    """A PDF page that is only a picture: no text layer. At 96 dpi it renders back to img's size."""
    img.save(path, "PDF", resolution=96)
    return path


def save(img: Image.Image, path: Path, **options) -> Path:
    img.save(path, **options)
    return path


def png_claiming(width: int, height: int) -> bytes:
    """A 57-byte PNG whose header declares width x height but which holds no pixel data at all."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def open_error(path: Path, **overrides) -> str:
    with pytest.raises(IngestError) as caught:
        open_document(path, settings(**overrides))
    return str(caught.value)


# --- bad inputs fail up front, with the fix in the message --------------------------------------------


def test_random_bytes_named_pdf_are_refused_as_not_a_pdf(tmp_path):
    path = tmp_path / "random.pdf"
    path.write_bytes(os.urandom(4096).replace(b"%PDF-", b"xxxxx"))
    message = open_error(path)
    assert "is not a PDF" in message and "re-download" in message


def test_a_pdf_header_followed_by_garbage_is_refused_as_corrupt(tmp_path):
    path = tmp_path / "garbage.pdf"
    path.write_bytes(b"%PDF-1.7\n" + os.urandom(4096))
    message = open_error(path)
    assert "corrupt or truncated" in message and "re-export" in message


def test_a_truncated_pdf_is_refused_as_corrupt(tmp_path):
    whole = text_pdf(tmp_path / "whole.pdf", ["first page", "second page"]).read_bytes()
    path = tmp_path / "half.pdf"
    path.write_bytes(whole[: len(whole) // 2])
    message = open_error(path)
    assert "corrupt or truncated" in message and "qpdf" in message


def hand_written_pdf(objects: list[bytes]) -> bytes:
    """A PDF assembled object by object, for damage no PDF writer would produce."""
    out, offsets = b"%PDF-1.4\n", []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    return out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)


def test_a_pdf_with_a_damaged_page_is_refused_naming_that_page(tmp_path):
    path = tmp_path / "damaged.pdf"
    path.write_bytes(hand_written_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R 4 0 R] /Count 2 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] >>",
        b"42",  # page 2 is not a page dictionary at all
    ]))  # fmt: skip
    message = open_error(path)
    assert message.startswith("page 2 ") and "damaged" in message and "qpdf" in message


@needs_qpdf
def test_a_password_protected_pdf_is_refused_with_the_qpdf_decrypt_fix(tmp_path):
    plain = text_pdf(tmp_path / "plain.pdf", ["secret figures"])
    locked = tmp_path / "locked.pdf"
    subprocess.run(["qpdf", "--encrypt", "user-pw", "owner-pw", "256", "--", plain, locked], check=True)
    message = open_error(locked)
    assert "password" in message and "qpdf --decrypt" in message


@pytest.mark.parametrize("name", ["empty.pdf", "empty.png"])
def test_an_empty_file_is_refused_before_any_parser_sees_it(tmp_path, name):
    path = tmp_path / name
    path.touch()
    assert open_error(path) == "file is empty (0 bytes): re-export or re-download it"


def test_an_unsupported_file_type_names_the_supported_ones(tmp_path):
    path = tmp_path / "report.docx"
    path.write_bytes(b"PK\x03\x04 not really a docx")
    assert open_error(path) == (
        "unsupported file type .docx: convert it to PDF or an image (PDF, PNG, JPEG, WebP, TIFF)"
    )


def test_an_image_over_the_pixel_limit_is_refused_from_its_header_without_decoding(tmp_path):
    # 9000 x 9000 = 81 MP: over the default 50 MP limit, under Pillow's own thresholds. The file holds no
    # pixel data at all, so reaching the size message proves nothing was decoded first.
    path = tmp_path / "bomb.png"
    path.write_bytes(png_claiming(9000, 9000))
    message = open_error(path)
    assert "9000x9000" in message and "raise MMRAG_MAX_IMAGE_PIXELS if the image is trusted" in message


def test_an_image_beyond_pillows_hard_limit_is_refused_with_a_downscale_fix(tmp_path):
    path = tmp_path / "huge.png"
    path.write_bytes(png_claiming(20000, 20000))  # 400 MP: Pillow itself refuses to open it
    message = open_error(path)
    assert "decompression-bomb" in message and "downscale it" in message


def test_the_pixel_limit_comes_from_settings(tmp_path):
    path = save(figure(size=(200, 100)), tmp_path / "small.png")
    assert "over the limit of 19,999" in open_error(path, max_image_pixels=19_999)
    with open_document(path, settings(max_image_pixels=20_000)) as doc:
        assert doc.num_pages == 1


def test_a_pdf_page_that_would_render_over_the_pixel_limit_is_refused_before_rendering(tmp_path):
    path = text_pdf(tmp_path / "big.pdf", ["an ordinary 4 x 3 inch page"])  # 384 x 288 px at 96 dpi
    message = open_error(path, max_image_pixels=100_000)
    assert "page 1 would render at 384x288" in message and "lower MMRAG_PDF_DPI" in message


def test_a_pdf_over_the_page_cap_is_refused_with_the_split_fix(tmp_path):
    path = text_pdf(tmp_path / "long.pdf", ["one", "two", "three"])
    message = open_error(path, max_pdf_pages=2)
    assert "3 pages" in message and "split it" in message and "MMRAG_MAX_PDF_PAGES" in message


def test_a_png_named_pdf_is_refused_with_a_rename_fix(tmp_path):
    path = save(figure(), tmp_path / "chart.pdf", format="PNG")
    assert open_error(path) == "the file is named .pdf but contains a PNG image: rename it to .png"


def test_a_pdf_named_png_is_refused_with_a_rename_fix(tmp_path):
    path = text_pdf(tmp_path / "slides.png", ["a PDF in disguise"])
    assert open_error(path) == "the file is named .png but contains a PDF: rename it to .pdf"


@pytest.mark.parametrize("fmt, suffix", [("PNG", ".png"), ("JPEG", ".jpg"), ("WEBP", ".webp"), ("TIFF", ".tif")])
def test_a_truncated_image_is_refused_at_open_by_a_full_decode(tmp_path, fmt, suffix):
    buf = io.BytesIO()
    figure().save(buf, fmt)
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])
    message = open_error(path)
    assert "cannot be decoded" in message and "re-download" in message


def test_a_missing_file_is_refused_with_check_the_path(tmp_path):
    assert "check the path" in open_error(tmp_path / "nowhere.pdf")


def test_ocr_on_without_tesseract_fails_once_at_open_with_the_install_fix(tmp_path, monkeypatch):
    # A real condition, not a mock: a PATH on which there is no tesseract binary.
    path = save(figure(), tmp_path / "scan.png")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert open_error(path, ocr=True) == (
        "tesseract is not installed: apt-get install tesseract-ocr tesseract-ocr-eng, or set MMRAG_OCR=false"
    )
    with open_document(path, settings(ocr=False)) as doc:  # and OCR off needs no tesseract at all
        assert [p.text_source for p in doc.pages()] == [TextSource.NONE]


@needs_tesseract
def test_ocr_with_a_language_that_is_not_installed_names_its_package(tmp_path):
    path = save(figure(), tmp_path / "scan.png")
    message = open_error(path, ocr=True, ocr_lang="eng+zzz")
    assert "apt-get install tesseract-ocr-zzz" in message and "MMRAG_OCR_LANG" in message


# --- discovery ---------------------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "sub" / ".cache").mkdir()
    for rel in ["b.PNG", "a.pdf", "notes.docx", "manifest.json", ".DS_Store", "sub/c.jpeg", "sub/deeper/d.TIFF",
                ".git/e.pdf", "sub/.cache/f.png", "sub/.hidden.pdf"]:  # fmt: skip
        (root / rel).write_bytes(b"x")
    return root


def test_discover_without_recursive_takes_the_top_level_and_ignores_subdirectories(corpus):
    files, failures = discover([corpus], recursive=False)
    assert files == [corpus / "a.pdf", corpus / "b.PNG"]
    assert failures == [FileFailure(str(corpus / "notes.docx"), "unsupported file type .docx: convert it to "
                                    "PDF or an image (PDF, PNG, JPEG, WebP, TIFF)")]  # fmt: skip


def test_discover_reports_office_documents_in_a_folder_but_passes_over_other_files(corpus):
    files, failures = discover([corpus], recursive=False)
    assert str(corpus / "notes.docx") in [f.path for f in failures]
    assert str(corpus / "manifest.json") not in [f.path for f in failures] + [str(p) for p in files]
    named, failed = discover([corpus / "manifest.json"], recursive=False)
    assert named == [] and "unsupported file type .json" in failed[0].error


def test_discover_with_recursive_walks_the_tree_sorted_and_skips_hidden_entries(corpus):
    files, failures = discover([corpus], recursive=True)
    assert files == [corpus / "a.pdf", corpus / "b.PNG", corpus / "sub/c.jpeg", corpus / "sub/deeper/d.TIFF"]
    assert [f.path for f in failures] == [str(corpus / "notes.docx")]


def test_discover_keeps_explicit_files_as_given_and_reports_missing_and_unsupported_ones(corpus, tmp_path):
    missing = tmp_path / "gone.pdf"
    files, failures = discover([corpus / "sub/c.jpeg", missing, corpus / "notes.docx"], recursive=False)
    assert files == [corpus / "sub/c.jpeg"]
    assert failures[0] == FileFailure(str(missing), "no such file or directory: check the path")
    assert failures[1].path == str(corpus / "notes.docx") and "convert it to PDF" in failures[1].error


def test_discover_lists_a_file_reached_twice_once(corpus):
    (corpus / "link.pdf").symlink_to(corpus / "a.pdf")
    files, failures = discover([corpus / "a.pdf", corpus], recursive=False)
    assert files == [corpus / "a.pdf", corpus / "b.PNG"] and len(failures) == 1


# --- rendering and text ------------------------------------------------------------------------------


def test_a_text_layer_pdf_yields_its_text_per_page(tmp_path):
    lines = ["Revenue grew 12% in the third quarter", "Costs   fell    sharply in 2024"]
    path = text_pdf(tmp_path / "report.pdf", lines)
    with open_document(path, settings(ocr=True)) as doc:  # OCR on, yet not needed: the text layer wins
        pages = list(doc.pages())
    assert [p.page for p in pages] == [1, 2]
    assert [p.text for p in pages] == ["Revenue grew 12% in the third quarter", "Costs fell sharply in 2024"]
    assert {p.text_source for p in pages} == {TextSource.TEXT_LAYER}
    assert all(p.image.mode == "RGB" and p.image.size == (384, 288) for p in pages)
    assert all(set(p.timings) == {"render", "text", "figures"} and p.figures == [] for p in pages)  # text only


def test_a_document_carries_its_identity(tmp_path):
    path = text_pdf(tmp_path / "id.pdf", ["identity"])
    with open_document(tmp_path / "." / "id.pdf", settings()) as doc:
        assert doc.path == str(path.resolve()) and doc.doc == "id.pdf" and doc.num_pages == 1
        assert doc.doc_id == doc_id_for(str(path.resolve()))
        assert doc.file_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        page = next(doc.pages())
    assert (page.doc_id, page.doc, page.path) == (doc.doc_id, "id.pdf", doc.path)


def test_an_image_only_pdf_page_has_no_text_when_ocr_is_off(tmp_path):
    path = image_pdf(tmp_path / "scan.pdf", figure())
    with open_document(path, settings(ocr=False)) as doc:
        (page,) = doc.pages()
    assert (page.text, page.text_source) == ("", TextSource.NONE)
    assert "ocr" not in page.timings


@needs_tesseract
def test_an_image_only_pdf_page_falls_back_to_ocr_when_it_is_on(tmp_path):
    path = image_pdf(tmp_path / "scan.pdf", figure())
    with open_document(path, settings(ocr=True)) as doc:
        (page,) = doc.pages()
    assert page.text_source is TextSource.OCR
    assert "revenue grew twelve percent" in page.text.lower()
    assert page.timings["ocr"] > 0


@needs_tesseract
def test_an_image_file_is_ocred_when_ocr_is_on(tmp_path):
    path = save(figure(), tmp_path / "slide.png")
    with open_document(path, settings(ocr=True)) as doc:
        (page,) = doc.pages()
    assert page.text_source is TextSource.OCR and "twelve" in page.text.lower()


@pytest.mark.parametrize("suffix, options", [(".webp", {"lossless": True}), (".tiff", {"compression": "tiff_lzw"})])
def test_the_same_picture_in_a_lossless_format_has_the_same_content_hash(tmp_path, suffix, options):
    png = save(figure(), tmp_path / "fig.png")
    other = save(figure(), tmp_path / f"fig{suffix}", **options)
    changed = save(figure(colour="darkred"), tmp_path / "changed.png")
    hashes = {}
    for path in (png, other, changed):
        with open_document(path, settings()) as doc:
            hashes[path.name] = next(doc.pages()).content_hash
    assert hashes["fig.png"] == hashes[f"fig{suffix}"]
    assert hashes["changed.png"] != hashes["fig.png"]


def test_transparency_is_composited_over_white_deterministically(tmp_path):
    # Fully transparent pixels whose hidden colours differ must come out identical (white), and a
    # half-transparent red must blend with white the same way every time.
    def rgba(hidden: tuple[int, int, int]) -> Image.Image:
        img = Image.new("RGBA", (4, 2), (*hidden, 0))
        img.putpixel((0, 0), (255, 0, 0, 128))
        return img

    pages = []
    for name, hidden in [("a.png", (12, 34, 56)), ("b.png", (200, 100, 0))]:
        with open_document(save(rgba(hidden), tmp_path / name), settings()) as doc:
            pages.append(next(doc.pages()))
    assert pages[0].image.mode == "RGB"
    assert pages[0].image.getpixel((1, 1)) == (255, 255, 255)
    assert pages[0].image.getpixel((0, 0)) == (255, 127, 127)
    assert pages[0].content_hash == pages[1].content_hash


def test_a_multi_frame_tiff_is_one_page_per_frame(tmp_path):
    frames = [figure(f"frame {n}", size=(300, 120)) for n in (1, 2, 3)]
    path = tmp_path / "scan.tiff"
    frames[0].save(path, save_all=True, append_images=frames[1:], compression="tiff_deflate")
    with open_document(path, settings()) as doc:
        pages = list(doc.pages())
    assert doc.num_pages == 3 and [p.page for p in pages] == [1, 2, 3]
    assert len({p.content_hash for p in pages}) == 3
    # Issue 41: 1,000 frames were 1,000 pages. Frames are pages under the page bound, refused before decoding.
    with pytest.raises(IngestError, match="3 frames, each a page, over the limit of 2 pages.*MMRAG_MAX_PDF_PAGES"):
        open_document(path, settings(max_pdf_pages=2))


def test_an_animated_png_is_one_page(tmp_path):
    path = tmp_path / "anim.png"
    figure("one").save(path, save_all=True, append_images=[figure("two")])
    with open_document(path, settings()) as doc:
        assert doc.num_pages == 1


def test_a_photo_is_turned_upright_by_its_exif_orientation(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = save(figure(size=(300, 100)), tmp_path / "photo.jpg", exif=exif)
    with open_document(path, settings()) as doc:
        assert next(doc.pages()).image.size == (100, 300)


def test_pages_cannot_be_read_after_the_document_is_closed(tmp_path):
    path = text_pdf(tmp_path / "two.pdf", ["one", "two"])
    with open_document(path, settings()) as doc:
        pages = doc.pages()
        next(pages)
    with pytest.raises(ValueError, match="closed"):
        next(pages)


def test_text_is_whitespace_normalised():
    assert normalise_text("  Revenue\t grew\r\n\r\n 12%  \x0c\r\nin 2024 \n") == "Revenue grew\n12%\nin 2024"


def test_tesseract_runs_with_omp_thread_limit_1_without_touching_this_process(tmp_path, monkeypatch):
    # A stand-in tesseract on PATH that prints the variable it was given: the only way to see the child's
    # environment. The real binary is exercised by the OCR tests above.
    fake = tmp_path / "bin" / "tesseract"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncat > /dev/null\necho "limit=$OMP_THREAD_LIMIT"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.delenv("OMP_THREAD_LIMIT", raising=False)
    assert ocr.ocr_image(figure(), "eng").strip() == "limit=1"
    assert "OMP_THREAD_LIMIT" not in os.environ


def test_one_page_renders_alone_as_the_walk_renders_it(tmp_path):
    path = text_pdf(tmp_path / "three.pdf", ["first page", "second page", "third page"])
    with open_document(path, settings(ocr=False)) as doc:
        walked = [p.content_hash for p in doc.pages()]
        assert [doc.page(n).content_hash for n in (1, 2, 3)] == walked
        assert doc.page(0) is None and doc.page(4) is None
    assert render_page(path, 2, settings()).content_hash == walked[1]
    assert render_page(path, 4, settings()) is None
    with pytest.raises(ValueError, match="closed"):
        doc.page(1)


def test_pdf_pages_render_from_many_threads_at_once_as_they_do_alone(sample_corpus):
    """pdfium is not thread-safe: page images rendered at once (the page-image route, ingest workers, tier
    encodes) crashed the server with SIGSEGV. Its calls take turns (PDFIUM_LOCK): from 8 threads, every page,
    figure crops included, comes out as it does alone."""
    from concurrent.futures import ThreadPoolExecutor

    conf = settings(figures=True)
    jobs = [(path, n) for path in sorted(sample_corpus.glob("*.pdf"))[:3] for n in (1, 2)] * 4
    alone = {(path, n): render_page(path, n, conf) for path, n in set(jobs)}

    def whole_document(path: Path) -> list[str]:
        with open_document(path, conf) as doc:
            return [p.content_hash for p in doc.pages()]

    with ThreadPoolExecutor(8) as pool:
        pages = list(pool.map(lambda job: render_page(*job, conf), jobs))
        documents = list(pool.map(whole_document, [path for path, _ in jobs[:6]]))
    for (path, n), page in zip(jobs, pages):
        want = alone[(path, n)]
        assert page.content_hash == want.content_hash and page.text == want.text
        assert [c.content_hash for c in page.figures] == [c.content_hash for c in want.figures]
    for path, hashes in zip([path for path, _ in jobs[:6]], documents):
        assert hashes[:2] == [alone[(path, 1)].content_hash, alone[(path, 2)].content_hash]
