"""`mmrag ingest` end to end on the sample corpus with the tiny model, Qdrant local mode and a real store."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from PIL import Image

from mmrag.core.keys import ImageKey
from mmrag.devkit.pdfbuild import PageBuilder, join_pages
from ingestion import figures
from mmrag.core.settings import Settings
from mmrag.adapters.embed import TextEmbedder
from mmrag.adapters.qdrant import PageIndex
from ingestion.pipeline import Ingestor, IngestReport
from mmrag.adapters.store import DiskFeatureStore
from mmrag.wiring import feature_store
from mmrag.adapters.vision import VisionEncoder
from mmrag.wiring import page_index
from tests.waiting import eventually_sync

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def encoder(tiny_model) -> VisionEncoder:
    return VisionEncoder(tiny_model, Settings(model=str(tiny_model)).vision.resolution_policy)


@pytest.fixture(scope="module")
def text_embedder() -> TextEmbedder:
    return TextEmbedder()


def make_ingestor(data_dir: Path, tiny_model: Path, encoder, text_embedder, **overrides) -> Ingestor:
    settings = Settings(model=str(tiny_model), data_dir=data_dir, ocr=False, **overrides)
    return Ingestor(
        settings.documents,
        vision_batch_size=settings.ingestion.vision_batch_size,
        encoder=encoder,
        store=feature_store(settings),
        index=page_index(settings, text_embedder.dim),
        text_embedder=text_embedder,
    )


def close(ingestor: Ingestor) -> None:
    ingestor.index.client.close()


def points_by_id(index: PageIndex) -> dict:
    return {p.id: p.payload for p in index.points()}


def manifest_pages(corpus: Path) -> list[dict]:
    docs = json.loads((corpus / "manifest.json").read_text())["documents"]
    return [dict(page, file=d["file"]) for d in docs for page in d["pages"]]


def test_ingesting_the_sample_corpus_indexes_every_page_and_shares_recurring_figures(
    tmp_path, sample_corpus, tiny_model, encoder, text_embedder
):
    ing = make_ingestor(tmp_path / "data", tiny_model, encoder, text_embedder)
    report = ing.run([sample_corpus])
    pages = manifest_pages(sample_corpus)
    assert report.failed == []
    assert report.pages == len(pages) == ing.index.count()
    distinct = {p["image_key"] for p in points_by_id(ing.index).values()}
    figures = {f["image_key"] for p in points_by_id(ing.index).values() for f in p["figures"]}
    # One vision forward per distinct page image: duplicated pages are encoded once and shared; and one per
    # distinct figure crop (the PDFs' charts, MMRAG_FIGURES), each an entry of its own.
    assert report.encoded == len(distinct) and report.figures_encoded == len(figures - distinct) > 0
    assert len(list(ing.store.keys())) == len(distinct | figures)
    assert report.figures >= len(figures)
    assert report.cached == report.pages - report.encoded
    duplicates = [p for p in pages if p.get("duplicate_of")]
    assert duplicates and report.encoded < report.pages
    by_page = {(p["doc"], p["page"]): p["image_key"] for p in points_by_id(ing.index).values()}
    for dup in duplicates:
        file, page = dup["duplicate_of"].split("#")
        assert by_page[(dup["file"], dup["page"])] == by_page[(file, int(page))]
    payload = next(iter(points_by_id(ing.index).values()))
    assert {"doc_id", "doc", "path", "page", "image_key", "text", "content_hash"} <= payload.keys()
    close(ing)


def test_reingesting_an_unchanged_corpus_encodes_nothing_and_writes_no_point(
    tmp_path, sample_corpus, tiny_model, encoder, text_embedder, monkeypatch
):
    ing = make_ingestor(tmp_path / "data", tiny_model, encoder, text_embedder)
    ing.run([sample_corpus])
    before = points_by_id(ing.index)
    writes = []
    monkeypatch.setattr(ing.index, "replace_document", lambda *a, **k: writes.append(a))  # a spy, not a fake
    forwards = encoder.forwards
    again = ing.run([sample_corpus])
    assert (again.encoded, encoder.forwards - forwards, writes) == (0, 0, [])
    assert again.cached == again.pages == len(before)
    assert points_by_id(ing.index) == before
    close(ing)


def test_adding_one_file_encodes_only_its_pages(tmp_path, sample_corpus, tiny_model, encoder, text_embedder):
    corpus = tmp_path / "corpus"
    shutil.copytree(sample_corpus, corpus)
    ing = make_ingestor(tmp_path / "data", tiny_model, encoder, text_embedder)
    first = ing.run([corpus])
    Image.new("RGB", (640, 360), (12, 200, 90)).save(corpus / "new-slide.png")
    second = ing.run([corpus])
    assert (second.encoded, second.pages - second.cached) == (1, 1)
    assert ing.index.count() == first.pages + 1
    close(ing)


def test_bad_files_leave_no_point_and_the_others_still_ingest(
    tmp_path, sample_corpus, tiny_model, encoder, text_embedder
):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    good = sorted(sample_corpus.glob("*.png"))[0]
    shutil.copy(good, corpus / good.name)
    (corpus / "empty.pdf").write_bytes(b"")
    (corpus / "notes.docx").write_bytes(b"PK\x03\x04 not a document we read")
    # Page 1 is fine; page 2 is so large at the DPI that it trips the pixel limit: no page of it may be stored.
    pages = [Image.new("RGB", (100, 100), (255, 255, 255)), Image.new("RGB", (3000, 3000), (0, 0, 0))]
    pages[0].save(corpus / "half.pdf", save_all=True, append_images=pages[1:], resolution=72.0)
    ing = make_ingestor(tmp_path / "data", tiny_model, encoder, text_embedder,
                        vision_batch_size=1, max_image_pixels=4_000_000, pdf_dpi=72)
    report = ing.run([corpus])
    failed = {Path(f.path).name: f.error for f in report.failed}
    assert set(failed) == {"empty.pdf", "notes.docx", "half.pdf"}, failed
    assert all(len(msg) > 20 for msg in failed.values())
    docs = {p["doc"] for p in points_by_id(ing.index).values()}
    assert docs == {good.name}
    assert report.pages == 1
    close(ing)


def test_pages_past_the_processors_aspect_ratio_are_fitted_and_one_bad_file_fails_alone(
    tmp_path, sample_corpus, tiny_model, encoder, text_embedder, monkeypatch
):
    """Issue 41: a 10000 x 1 image or a 14400 x 30 pt PDF page raised from the processor's resize and the whole run
    failed, every file unindexed. They are fitted (ingestion/raster.py) and indexed; a file whose fitting would pass
    the pixel bound fails alone with the fix, and so does a file that fails in a way nobody foresaw (here a
    stand-in error raised for it), while the rest of the folder is indexed."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    good = sorted(sample_corpus.glob("*.png"))[0]
    shutil.copy(good, corpus / good.name)
    shutil.copy(good, corpus / "boom.png")
    Image.new("RGB", (10_000, 1), (30, 60, 90)).save(corpus / "wide.png")
    Image.new("RGB", (14_400, 30), (90, 60, 30)).save(corpus / "long.pdf", resolution=72.0)  # 14400 x 30 pt
    Image.new("RGB", (30_000, 1)).save(corpus / "overbound.png")  # fitted: 30000 x 150, over 4 M pixels
    ing = make_ingestor(tmp_path / "data", tiny_model, encoder, text_embedder, max_image_pixels=4_000_000, pdf_dpi=72)
    process = ing._process_batch

    def process_or_fail(doc, batch, report, lease):
        if doc.doc == "boom.png":
            raise RuntimeError("stand-in for an error nobody foresaw")
        return process(doc, batch, report, lease)

    monkeypatch.setattr(ing, "_process_batch", process_or_fail)
    report = ing.run([corpus])
    failed = {Path(f.path).name: f.error for f in report.failed}
    assert set(failed) == {"overbound.png", "boom.png"}, failed
    assert "aspect ratio over 200:1" in failed["overbound.png"] and "cut it into parts" in failed["overbound.png"]
    assert failed["boom.png"].startswith("unexpected RuntimeError (stand-in") and "MMRAG_LOG_LEVEL=DEBUG" in \
        failed["boom.png"]
    points = points_by_id(ing.index).values()
    assert {p["doc"] for p in points} == {good.name, "wide.png", "long.pdf"} and report.pages == 3
    for p in points:  # the fitted pages' tokens are stored: a question can be asked about them
        assert ing.store.contains(ImageKey.parse(p["image_key"]))
    close(ing)


def test_random_clip_fills_the_image_channel_when_switched_on(tmp_path, sample_corpus, tiny_model, encoder,
                                                               text_embedder):
    from mmrag.adapters.embed import ImageEmbedder

    settings = Settings(model=str(tiny_model), data_dir=tmp_path / "data", ocr=False, page_retriever="clip")
    image = ImageEmbedder(settings.retrieval.clip_model, None)
    ing = Ingestor(settings.documents, encoder=encoder, store=feature_store(settings),
                   index=page_index(settings, text_embedder.dim), text_embedder=text_embedder, image_embedder=image)
    one = sorted(sample_corpus.glob("*.png"))[:2]
    ing.run([*one, sample_corpus / "q3_quarterly_report.pdf"])
    points = ing.index.points(with_vectors=True)
    assert len(points) > 2 and all(len(p.vector["image"]) == image.dim for p in points)
    # Issue 26: every figure of the report is a point with its crop's CLIP vector (the page-image channel).
    figures = ing.index.figure_points(with_vectors=True)
    assert figures and len(figures) == sum(len(p.payload["figures"]) for p in points)
    assert all(len(f.vector["image"]) == image.dim for f in figures)
    close(ing)


def test_redis_backend_stores_the_same_entries(tmp_path, sample_corpus, tiny_model, encoder, text_embedder,
                                               redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    ing = make_ingestor(tmp_path / "data", tiny_model, encoder, text_embedder, redis_url=redis_url)
    report = ing.run(sorted(sample_corpus.glob("*.png"))[:3])
    assert ing.store.backend == "redis"
    assert len(list(ing.store.keys())) == report.encoded > 0
    assert ing.store.stats.writes == report.encoded
    close(ing)


# --- the CLI as a user runs it ------------------------------------------------------------------------


def cli_env(data_dir: Path, tiny_model: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, MMRAG_DATA_DIR=str(data_dir), MMRAG_MODEL=str(tiny_model), MMRAG_OCR="false",
               HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmrag", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def _rounded(vector):
    """A stored vector, comparable across runs: dense rows rounded, a sparse one as (indices, rounded values)."""
    if hasattr(vector, "indices"):
        return tuple(vector.indices), tuple(round(x, 5) for x in vector.values)
    return [round(x, 5) for x in vector]


def snapshot(data_dir: Path) -> tuple[dict, dict]:
    """Feature entries (name → bytes) and points (id → payload) of a data dir: what "the store" is."""
    features = {p.name: p.read_bytes() for p in DiskFeatureStore(data_dir / "features").root.glob("??/*")}
    from qdrant_client import QdrantClient

    client = QdrantClient(path=str(data_dir / "qdrant"))
    try:
        points, _ = client.scroll("mmrag_pages", limit=10_000, with_payload=True, with_vectors=True)
        return features, {p.id: (p.payload, {k: _rounded(v) for k, v in p.vector.items()}) for p in points}
    finally:
        client.close()


FP32_NORMWISE_RTOL = 1e-5  # ~100 fp32 epsilons of the whole tensor's norm


def fp32_rounding_apart(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Two fp32 results of the same computation, told apart from different ones: same shape, and the normwise
    relative error ||got - want|| / ||want|| within FP32_NORMWISE_RTOL (see assert_same_features)."""
    if got.shape != want.shape:
        return False
    diff, scale = (got - want).double().norm(), want.double().norm()
    return bool(diff <= FP32_NORMWISE_RTOL * scale)


def assert_same_features(features: dict[str, bytes], expected: dict[str, bytes], kept: dict[str, bytes]) -> None:
    """An interrupted-then-resumed store against the uninterrupted one (``snapshot(...)[0]`` of each).

    Exact where the interruption could break something: the same entry names (keys), the same grids, and what
    the interrupted run wrote (``kept``) unchanged (a rerun skips stored keys, never rewrites them). The tokens
    the rerun recomputed are compared to fp32 rounding, not bitwise: they come from another process, and about one
    full run in ten one entry of 29 differs (a Sapphire Rapids and an Emerald Rapids host: 7.1e-5 on values of
    about 2.5, where thread count, batch and input were each ruled out). The measure is the normwise relative
    error, ||got - want|| / ||want||, as numerical linear algebra bounds a computation's rounding: a rounding
    difference inside a layer spreads over elements whose own magnitude does not bound it (an element near 0 can
    carry an error the size of its neighbours'), while another page, another encoder or a lost token changes the
    norm by orders of magnitude more (tested below). Bitwise reproducibility is test_wiring's thread-count
    test, within one process."""
    assert sorted(features) == sorted(expected)
    assert [n for n in kept if features[n] != kept[n]] == []
    differ = {}
    for name, blob in features.items():
        got, want = safetensors.torch.load(blob), safetensors.torch.load(expected[name])
        assert torch.equal(got["grid_thw"], want["grid_thw"]), name
        if not torch.equal(got["image_tokens"], want["image_tokens"]):
            differ[name] = (got["image_tokens"] - want["image_tokens"]).abs().max().item()
            assert fp32_rounding_apart(got["image_tokens"], want["image_tokens"]), (name, differ)
    print(f"entries bitwise equal to the uninterrupted run's: {len(features) - len(differ)} of {len(features)} "
          f"{differ}")


def test_fp32_rounding_apart_tells_a_rounding_difference_from_another_result():
    """The resumed-ingest comparison's measure, on tensors shaped as a page's tokens: the difference seen once in
    ten runs passes; another page, the same page through a bf16 encoder, a lost token, a sign flip do not."""
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(64, 64, generator=gen) * 1.2  # a tiny model's tokens: values of about 2.5 at most
    seen = want.clone()
    seen[3, 5] += 7.1e-5  # the entry that differed
    assert fp32_rounding_apart(want.clone(), want) and fp32_rounding_apart(seen, want)
    assert fp32_rounding_apart(want * (1 + 1e-6), want)  # rounding everywhere, a few epsilons each
    other_page = torch.randn(64, 64, generator=gen) * 1.2
    bf16 = want.to(torch.bfloat16).float()
    flipped = want.clone()
    flipped[0] = -flipped[0]
    assert not any(fp32_rounding_apart(t, want) for t in (other_page, bf16, flipped, want[:-1], want * 1.001))


def test_cli_json_report_has_the_documented_shape_and_exit_code(tmp_path, sample_corpus, tiny_model):
    bad = tmp_path / "broken.pdf"
    bad.write_bytes(b"%PDF-1.7\n garbage")
    result = run_cli("ingest", str(sorted(sample_corpus.glob("*.png"))[0]), str(bad), "--json",
                     env=cli_env(tmp_path / "data", tiny_model))
    assert result.returncode == 1, result.stderr
    out = json.loads(result.stdout)
    assert {"files", "pages", "encoded", "cached", "failed", "seconds"} <= out.keys()
    assert (out["files"], out["pages"], out["encoded"]) == (2, 1, 1)
    assert out["failed"][0]["path"].endswith("broken.pdf") and out["failed"][0]["error"]


def test_a_run_killed_half_way_and_rerun_ends_with_the_uninterrupted_store(tmp_path, sample_corpus, tiny_model,
                                                                           reference_store):
    # Batch size 1 in both runs (the reference's too): batching may round differently.
    expected = reference_store

    killed = tmp_path / "killed"
    env = cli_env(killed, tiny_model, MMRAG_VISION_BATCH_SIZE="1")
    proc = subprocess.Popen([sys.executable, "-m", "mmrag", "ingest", str(sample_corpus)], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    features = killed / "features"

    def half_written() -> bool:
        if len(list(features.glob("??/*.safetensors"))) >= len(expected[0]) // 2:
            return True
        if proc.poll() is not None:
            pytest.fail("the run finished before it could be killed; make the corpus larger")
        return False

    eventually_sync(half_written, timeout=300, what="half the reference's feature entries written")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = snapshot(killed)
    assert len(partial[0]) < len(expected[0])

    assert run_cli("ingest", str(sample_corpus), env=env).returncode == 0
    features, points = snapshot(killed)
    assert_same_features(features, expected[0], kept=partial[0])
    assert points == expected[1]


def test_cli_says_what_to_do_when_the_qdrant_folder_is_held(tmp_path, sample_corpus, tiny_model):
    from qdrant_client import QdrantClient

    holder = QdrantClient(path=str(tmp_path / "data" / "qdrant"))
    try:
        result = run_cli("ingest", str(sample_corpus), env=cli_env(tmp_path / "data", tiny_model))
    finally:
        holder.close()
    assert result.returncode == 2
    assert "MMRAG_QDRANT_URL" in result.stderr and "Traceback" not in result.stderr


def test_an_ingested_page_over_the_bound_keeps_its_image_and_text_and_reports_its_figures_skipped(
        tmp_path, tiny_model, encoder, text_embedder, monkeypatch):
    """Issue 41, item 2: the page over the figure step's bound is indexed with its image and text, its figures
    skipped and said in the report; the other page's figures are found as ever."""
    heavy, light = PageBuilder(), PageBuilder()
    heavy.body(72, 3)
    for k in range(300):
        x, y = 102 + (k * 97) % 396, 302 + (k * 61) % 196
        heavy.rect((x, y, x + 1.5, y + 1.5), fill=True)
    light.body(72, 3)
    light.chart((120, 150, 480, 400))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "two.pdf").write_bytes(join_pages([heavy.bytes(), light.bytes()]))
    monkeypatch.setattr(figures, "MAX_PAGE_OBJECTS", 200)
    ing = make_ingestor(tmp_path / "data", tiny_model, encoder, text_embedder, figures=True)
    try:
        report = ing.run([tmp_path / "docs"])
        assert not report.failed and report.pages == 2
        (skipped,) = report.to_json()["figures_skipped"]
        assert skipped["doc"] == "two.pdf" and skipped["page"] == 1 and "drawing objects, over 200" in skipped["why"]
        pages = [p for p in points_by_id(ing.index).values() if p.get("figure") is None]
        assert sorted(p["page"] for p in pages) == [1, 2]
        assert report.figures >= 1  # the light page's chart
    finally:
        close(ing)



def test_a_job_is_told_between_two_pages_of_one_batch_so_a_cancel_or_another_tenant_waits_one_page(
        tmp_path, tiny_model, encoder, text_embedder):
    """Issue 41, item 2: the progress callback (where a job stops when cancelled and runs other tenants' queued
    jobs) runs between two pages' loads, not only after each batch: five pages in one batch of eight are five
    calls before the batch is encoded, and a callback that raises after the second page stops the file there, its
    earlier version still indexed as it was."""
    pages = []
    for k in range(5):
        page = PageBuilder()
        page.body(72, 2)
        page.chart((120, 150 + 20 * k, 480, 400))
        pages.append(page.bytes())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "five.pdf").write_bytes(join_pages(pages))
    ing = make_ingestor(tmp_path / "data", tiny_model, encoder, text_embedder, vision_batch_size=8)
    try:
        calls = []
        report = ing.run([tmp_path / "docs"], progress=lambda files, total, done: calls.append((files, done)))
        assert report.pages == 5 and not report.failed
        assert calls[:5] == [(0, 0)] * 4 + [(0, 5)]  # before pages 2..5 are loaded, then after the batch

        class Stop(Exception):
            pass

        def stop_after_two(files: int, total: int, done: int) -> None:
            stop_after_two.calls += 1
            if stop_after_two.calls == 2:
                raise Stop
        stop_after_two.calls = 0
        before = points_by_id(ing.index)
        (tmp_path / "docs" / "five.pdf").write_bytes(join_pages(pages[::-1]))  # changed: ingested again
        with pytest.raises(Stop):
            ing.ingest_file(tmp_path / "docs" / "five.pdf", IngestReport(),
                            on_batch=lambda done: stop_after_two(0, 1, done))
        assert stop_after_two.calls == 2 and points_by_id(ing.index) == before
    finally:
        close(ing)


def test_a_batch_holds_at_most_its_pixels_and_a_page_over_them_is_a_batch_of_its_own():
    """Issue 41: the pages held at once are bounded by their decoded pixels (MMRAG_MAX_IMAGE_PIXELS), not only by
    MMRAG_VISION_BATCH_SIZE: a multi-frame TIFF's 7000x7000 frames go one by one."""
    from mmrag.core.keys import ContentHash
    from mmrag.core.pages import RenderedPage
    from ingestion.pipeline import batches

    def page(side: int) -> RenderedPage:
        return RenderedPage(doc_id="d", doc="d.tif", path="d.tif", page=1, image=Image.new("1", (side, side)),
                            content_hash=ContentHash(f"{side:064x}"))

    sides = [100, 100, 7000, 100, 7000, 7000, 100, 100, 100]
    got = [[p.image.width for p in b] for b in batches(iter(page(s) for s in sides), 4, 7000 * 7000)]
    assert got == [[100, 100], [7000], [100], [7000], [7000], [100, 100, 100]]
    assert [len(b) for b in batches(iter(page(100) for _ in range(9)), 4, 50_000_000)] == [4, 4, 1]
    assert [len(b) for b in batches(iter(page(s) for s in sides), 4)] == [4, 4, 1]  # no bound: by count
