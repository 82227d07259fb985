"""The sample corpus: reproducible files, real text layers, declared duplicate pages, a usable question set."""

from __future__ import annotations

import re
import shutil
from collections import defaultdict
from pathlib import Path

import pypdfium2 as pdfium
import pytest
from PIL import Image

from mmrag.core.keys import ContentHash, content_hash_of
from mmrag.devkit.corpus import AnswerRef, CorpusManifest, build_sample_corpus

RENDER_DPI = 96  # the ingestion default (Settings.pdf_dpi): page identity is defined at this resolution


@pytest.fixture(scope="module")
def manifest(sample_corpus: Path) -> CorpusManifest:
    return CorpusManifest.load(sample_corpus / "manifest.json")


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CorpusManifest]:
    """A second build with the same (default) seed, in its own folder."""
    out = tmp_path_factory.mktemp("corpus_again")
    return out, build_sample_corpus(out)


@pytest.fixture(scope="module")
def page_images(sample_corpus: Path, manifest: CorpusManifest) -> dict[AnswerRef, Image.Image]:
    """Every page as ingestion sees it: PDFs rendered by pdfium at 96 dpi, PNGs decoded; all RGB."""
    images: dict[AnswerRef, Image.Image] = {}
    for doc in manifest.documents:
        path = sample_corpus / doc.file
        if doc.kind == "png":
            images[AnswerRef(doc.file, 1)] = Image.open(path).convert("RGB")
            continue
        pdf = pdfium.PdfDocument(path)
        for i in range(len(pdf)):
            images[AnswerRef(doc.file, i + 1)] = pdf[i].render(scale=RENDER_DPI / 72).to_pil().convert("RGB")
        pdf.close()
    return images


def _page_text(path: Path, page: int) -> str:
    pdf = pdfium.PdfDocument(path)
    text = pdf[page - 1].get_textpage().get_text_range()
    pdf.close()
    return " ".join(text.split())  # pdfium breaks wrapped lines with \r\n


def _hash(image: Image.Image) -> ContentHash:
    return content_hash_of(image.mode, image.size, image.tobytes())


_STOPWORDS = frozenset(
    "the and was were for how did does what which with from that this are its who why when will many much "
    "per has have had been than into any".split()
)


def _content_words(text: str) -> set[str]:
    """Words that carry the answer: numbers, and words of three or more letters that are not stopwords."""
    return {w for w in re.findall(r"\d+(?:[.,]\d+)*|[a-z]+", text.lower()) if w.isdigit() or w[0].isdigit()
            or (len(w) >= 3 and w not in _STOPWORDS)}


def _ocr(image: Image.Image, monkeypatch: pytest.MonkeyPatch) -> str:
    if shutil.which("tesseract") is None:
        pytest.skip("tesseract not installed: apt-get install tesseract-ocr")
    import pytesseract

    monkeypatch.setenv("OMP_THREAD_LIMIT", "1")  # tesseract's OpenMP threads oversubscribe 2-core runners
    return " ".join(pytesseract.image_to_string(image).lower().split())


def test_the_same_seed_writes_byte_identical_files(sample_corpus: Path, rebuilt: tuple[Path, CorpusManifest]) -> None:
    again, _ = rebuilt
    first = {p.name: p.read_bytes() for p in sample_corpus.iterdir()}
    second = {p.name: p.read_bytes() for p in again.iterdir()}
    assert sorted(first) == sorted(second)
    changed = [name for name in first if first[name] != second[name]]
    assert changed == [], f"files differ between two builds with the same seed: {changed}"


def test_a_different_seed_moves_incidental_data_but_keeps_the_facts(
    sample_corpus: Path, manifest: CorpusManifest, tmp_path: Path
) -> None:
    other = build_sample_corpus(tmp_path, seed=1)
    assert other == manifest
    assert (tmp_path / "operations_manual.pdf").read_bytes() != (sample_corpus / "operations_manual.pdf").read_bytes()


def test_the_manifest_on_disk_loads_back_to_what_build_returned(rebuilt: tuple[Path, CorpusManifest]) -> None:
    out, returned = rebuilt
    assert CorpusManifest.load(out / "manifest.json") == returned
    assert CorpusManifest.load(out) == returned  # the corpus folder works too


def test_the_corpus_has_multi_page_pdfs_png_slides_and_one_scanned_page(manifest: CorpusManifest) -> None:
    pdfs = [d for d in manifest.documents if d.kind == "pdf"]
    pngs = [d for d in manifest.documents if d.kind == "png"]
    assert len(pdfs) >= 5 and all(3 <= len(d.pages) <= 6 for d in pdfs)
    assert len(pngs) >= 6 and all(len(d.pages) == 1 for d in pngs)
    scanned = [(d.file, p.page) for d in pdfs for p in d.pages if not p.text_layer]
    assert len(scanned) == 1


def test_pdf_pages_carry_their_facts_in_the_text_layer(sample_corpus: Path, manifest: CorpusManifest) -> None:
    for doc, page in manifest.pages():
        if doc.kind != "pdf" or not page.text_layer:
            continue
        text = _page_text(sample_corpus / doc.file, page.page)
        assert page.title in text, f"{doc.file}#{page.page}"
        for fact in page.facts:
            assert fact in text, f"{doc.file}#{page.page} lacks {fact!r} in its text layer: {text[:300]!r}"


def test_the_scanned_page_has_no_text_layer(sample_corpus: Path, manifest: CorpusManifest) -> None:
    scanned = [(d, p) for d, p in manifest.pages() if d.kind == "pdf" and not p.text_layer]
    for doc, page in scanned:
        assert _page_text(sample_corpus / doc.file, page.page) == ""


def test_png_slides_are_1280_by_720_rgb(sample_corpus: Path, manifest: CorpusManifest) -> None:
    for doc in manifest.documents:
        if doc.kind == "png":
            with Image.open(sample_corpus / doc.file) as image:
                assert (image.size, image.mode) == ((1280, 720), "RGB"), doc.file


def test_declared_duplicate_pages_render_pixel_identical_and_all_other_pages_differ(
    manifest: CorpusManifest, page_images: dict[AnswerRef, Image.Image]
) -> None:
    by_hash: dict[ContentHash, set[AnswerRef]] = defaultdict(set)
    for ref, image in page_images.items():
        by_hash[_hash(image)].add(ref)
    identical = {frozenset(refs) for refs in by_hash.values() if len(refs) > 1}
    declared = set(manifest.duplicate_groups())
    assert identical == declared
    # The point of the corpus: one page recurs verbatim across three different documents.
    assert any(len({ref.file for ref in group}) >= 3 for group in declared)


def test_pages_that_share_a_figure_but_not_their_text_are_different_pages(
    manifest: CorpusManifest, page_images: dict[AnswerRef, Image.Image]
) -> None:
    canonical = {
        AnswerRef(d.file, p.page): p.duplicate_of or f"{d.file}#{p.page}" for d, p in manifest.pages()
    }
    by_figure: dict[str, set[str]] = defaultdict(set)
    for doc, page in manifest.pages():
        by_figure[page.figure].add(canonical[AnswerRef(doc.file, page.page)])
    shared = {figure: pages for figure, pages in by_figure.items() if len(pages) > 1}
    assert {"system_architecture", "regional_revenue_bars"} <= set(shared)
    for pages in shared.values():
        hashes = {_hash(page_images[AnswerRef.parse(p)]) for p in pages}
        assert len(hashes) == len(pages)


def test_every_page_states_a_fact_and_no_fact_appears_on_two_different_pages(manifest: CorpusManifest) -> None:
    owner: dict[str, str] = {}
    for doc, page in manifest.pages():
        assert page.facts, f"{doc.file}#{page.page} has no fact"
        canonical = page.duplicate_of or f"{doc.file}#{page.page}"
        for fact in page.facts:
            assert owner.setdefault(fact, canonical) == canonical, f"{fact!r} is on two different pages"


def test_at_least_60_questions_each_answered_by_every_copy_of_its_page(manifest: CorpusManifest) -> None:
    assert len(manifest.questions) >= 60
    assert len({q.question for q in manifest.questions}) == len(manifest.questions)
    pages = {AnswerRef(d.file, p.page): p for d, p in manifest.pages()}
    pages_with_fact: dict[str, set[AnswerRef]] = defaultdict(set)
    for ref, page in pages.items():
        for fact in page.facts:
            pages_with_fact[fact].add(ref)
    for q in manifest.questions:
        assert q.answers and all(a in pages for a in q.answers), q.question
        assert set(q.answers) == pages_with_fact[q.fact], q.question
    assert any(len(q.answers) == 3 for q in manifest.questions)  # the verbatim architecture page


def test_questions_paraphrase_their_fact_and_share_its_key_words(manifest: CorpusManifest) -> None:
    for q in manifest.questions:
        assert q.question.endswith("?")
        assert q.question.lower().rstrip("?") not in q.fact.lower()
        shared = _content_words(q.question) & _content_words(q.fact)
        assert len(shared) >= 2, f"{q.question!r} shares too little with {q.fact!r}: {shared}"


def test_ocr_reads_the_facts_on_every_slide(
    sample_corpus: Path, manifest: CorpusManifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    slides = [(d, p) for d, p in manifest.pages() if d.kind == "png" and p.duplicate_of is None]
    for doc, page in slides:
        text = _ocr(Image.open(sample_corpus / doc.file).convert("RGB"), monkeypatch)
        for fact in page.facts:
            missing = _content_words(fact) - _content_words(text)
            assert not missing, f"OCR of {doc.file} misses {missing} of {fact!r}: {text!r}"


def test_ocr_reads_the_facts_on_the_scanned_page_at_ingestion_resolution(
    manifest: CorpusManifest, page_images: dict[AnswerRef, Image.Image], monkeypatch: pytest.MonkeyPatch
) -> None:
    (doc, page), = [(d, p) for d, p in manifest.pages() if d.kind == "pdf" and not p.text_layer]
    text = _ocr(page_images[AnswerRef(doc.file, page.page)], monkeypatch)
    for fact in page.facts:
        missing = _content_words(fact) - _content_words(text)
        assert not missing, f"OCR of the scanned page misses {missing} of {fact!r}: {text!r}"
