"""`mmrag reencode`: pages of another encoder get the configured encoder's tokens in place, from their source files.

A copy of the sample corpus is ingested under SALT_A (the "old" encoder, as before an upgrade) and, as the
reference, under SALT_B into another data dir (what a fresh `mmrag ingest` after the upgrade writes). Each test
re-encodes a copy of the SALT_A data dir with SALT_B configured and compares it with the reference.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mmrag.adapters.embed import ImageEmbedder, TextEmbedder
from mmrag.adapters.store import DiskFeatureStore, FeatureStore, FeatureStoreError, RedisFeatureStore
from mmrag.adapters.vision import VisionCheckpoint
from mmrag.core.keys import ImageKey
from mmrag.core.payload import WITHOUT_PIXELS_FIX, EncoderScope, PagePayload
from ingestion.reencode import FILE_CHANGED, FILE_UNREADABLE
from mmrag import wiring
from mmrag.cli import app
from tests.waiting import eventually_sync

REPO = Path(__file__).resolve().parents[1]
SALT_A, SALT_B = "reencode-old", "reencode-new"
runner = CliRunner()


@dataclass(frozen=True)
class Corpus:
    src: Path  # the source files every page's payload path points into
    old: Path  # data dir ingested under SALT_A
    fresh: Path  # data dir ingested under SALT_B: the reference
    scope_a: EncoderScope
    scope_b: EncoderScope


def _settings(engine_settings, data: Path, salt: str, **extra):
    return engine_settings.replace(**{"data_dir": data, "encoder_salt": salt, "ocr": False,
                                              "redis_url": "", **extra})


def _ingest(settings, paths: list[Path]) -> None:
    ingestor = wiring.ingestor(settings)
    try:
        report = ingestor.run(paths)
    finally:
        ingestor.index.client.close()
    assert not report.failed and report.pages, report.to_json()


def _scope(settings) -> EncoderScope:
    return wiring.encoder_scope(settings, wiring.resolve_model(settings))


@pytest.fixture(scope="module")
def corpus(engine_settings, sample_corpus, tmp_path_factory) -> Corpus:
    src = tmp_path_factory.mktemp("reencode-src")
    for f in sample_corpus.iterdir():
        if f.suffix != ".json":
            shutil.copy(f, src)
    old, fresh = tmp_path_factory.mktemp("reencode-old"), tmp_path_factory.mktemp("reencode-fresh")
    _ingest(_settings(engine_settings, old, SALT_A), [src])
    _ingest(_settings(engine_settings, fresh, SALT_B), [src])
    scope_a, scope_b = _scope(_settings(engine_settings, old, SALT_A)), _scope(_settings(engine_settings, old, SALT_B))
    assert scope_a != scope_b
    return Corpus(src, old, fresh, scope_a, scope_b)


def _copy(data: Path, to: Path) -> Path:
    shutil.copytree(data / "qdrant", to / "qdrant")
    shutil.copytree(data / "features", to / "features", ignore=shutil.ignore_patterns(".leases"))
    return to


def _env(engine_settings, data: Path, salt: str, **extra: str) -> dict[str, str]:
    return {"MMRAG_DATA_DIR": str(data), "MMRAG_MODEL": engine_settings.model.name, "MMRAG_ENCODER_SALT": salt,
            "MMRAG_REDIS_URL": "", "MMRAG_OCR": "false", "HF_HUB_OFFLINE": "1", **extra}


def _points(settings) -> dict[str, tuple[dict, dict]]:
    """page id -> (payload, vectors), as stored."""
    index = wiring.read_index(settings)
    try:
        return {str(p.id): (p.payload, p.vector) for p in index.points(with_vectors=True)}
    finally:
        index.client.close()


def _pages(settings) -> dict[str, PagePayload]:
    return {page_id: PagePayload.from_qdrant(payload) for page_id, (payload, _) in _points(settings).items()}


def _no_embedder(*_a, **_kw):
    raise AssertionError("reencode must not construct an embedder")


@pytest.fixture(scope="module")
def reencoded(corpus, engine_settings, tmp_path_factory):
    """A copy of the SALT_A index re-encoded by `mmrag reencode --json` with SALT_B configured, with neither
    embedder constructible; what it printed, and the points before."""
    data = _copy(corpus.old, tmp_path_factory.mktemp("reencoded"))
    before = _points(_settings(engine_settings, data, SALT_A))
    env = _env(engine_settings, data, SALT_B)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TextEmbedder, "__init__", _no_embedder)
        mp.setattr(ImageEmbedder, "__init__", _no_embedder)
        dry = runner.invoke(app, ["reencode", "--dry-run", "--json"], env=env)
        assert _points(_settings(engine_settings, data, SALT_A)) == before  # a dry run writes nothing
        result = runner.invoke(app, ["reencode", "--json"], env=env)
    assert dry.exit_code == 0, dry.output
    assert result.exit_code == 0, result.output
    return {"data": data, "before": before, "dry": json.loads(dry.stdout), "out": json.loads(result.stdout),
            "settings": _settings(engine_settings, data, SALT_B)}


def test_reencode_gives_every_page_the_tokens_and_payload_a_fresh_ingest_writes(corpus, reencoded,
                                                                                engine_settings):
    settings, before, out = reencoded["settings"], reencoded["before"], reencoded["out"]
    fresh_settings = _settings(engine_settings, corpus.fresh, SALT_B)
    fresh = _pages(fresh_settings)
    # Each page's image and its figures' crops (issue 26): every entry a page references.
    distinct = {k for p in fresh.values() for k in p.image_keys}
    images = sum(len(p.image_keys) for p in fresh.values())
    assert (out["pages"], out["current"], out["reencoded"], out["skipped"]) == (len(before), 0, len(before), [])
    assert out["stale_by_encoder"] == {str(corpus.scope_a): len(before)}
    assert out["encoded"] == len(distinct) < images  # a figure repeated across pages is encoded once
    assert out["reused"] == images - len(distinct)
    assert out["unreferenced_entries"] == len({k for p, _ in before.values()
                                               for k in PagePayload.from_qdrant(p).image_keys})

    after = _points(settings)
    assert _pages(settings) == fresh  # every payload field, the fingerprint included, as a fresh ingest writes
    for page_id, (payload, vectors) in after.items():
        old_payload, old_vectors = before[page_id]
        assert vectors == old_vectors  # untouched: nothing was embedded
        assert {k: v for k, v in payload.items() if v != old_payload[k]}.keys() <= {
            "image_key", "encoder_version", "fingerprint", "image_tokens", "figures"}
        assert payload["text"] == old_payload["text"] and payload["text_source"] == old_payload["text_source"]

    store = DiskFeatureStore(settings.storage.features_dir)
    reference = DiskFeatureStore(fresh_settings.storage.features_dir)
    for key in distinct:
        got, want = store.get(key), reference.get(key)
        assert torch.equal(got.grid_thw, want.grid_thw)
        # Batches differ from the fresh ingest's (per file there, across files here): fp32 rounding may too.
        torch.testing.assert_close(got.image_tokens, want.image_tokens, rtol=0, atol=1e-5)

    check = runner.invoke(app, ["index", "check", "--json"],
                          env=_env(engine_settings, settings.storage.data_dir, SALT_B))
    assert check.exit_code == 0, check.output
    assert json.loads(check.stdout)["stale_pages"] == 0


def test_a_dry_run_counts_pages_per_old_encoder_and_the_forwards_needed(corpus, reencoded):
    dry, total = reencoded["dry"], len(reencoded["before"])
    assert dry["dry_run"] and dry["reencoded"] == 0
    assert dry["stale_by_encoder"] == {str(corpus.scope_a): total} and dry["to_reencode"] == total
    assert dry["encoded"] == reencoded["out"]["encoded"] and dry["files"] == reencoded["out"]["files"]


def test_after_reencode_ingest_finds_every_file_current_and_encodes_nothing(corpus, reencoded, engine_settings,
                                                                           tmp_path):
    data = _copy(reencoded["data"], tmp_path / "data")
    settings = _settings(engine_settings, data, SALT_B)
    before = _points(settings)
    result = runner.invoke(app, ["ingest", "--json", str(corpus.src)], env=_env(engine_settings, data, SALT_B))
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["encoded"] == 0 and out["unchanged_files"] == out["files"] == len(list(corpus.src.iterdir()))
    assert _points(settings) == before


def test_the_summary_says_how_to_free_the_old_entries(corpus, engine_settings, tmp_path):
    data = _copy(corpus.old, tmp_path / "data")
    result = runner.invoke(app, ["reencode"], env=_env(engine_settings, data, SALT_B))
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    n_old = len({k for p in _pages(_settings(engine_settings, corpus.old, SALT_A)).values() for k in p.image_keys})
    assert f"run `mmrag store gc --apply` to free {n_old} old entries" in text
    total = len(_pages(_settings(engine_settings, corpus.old, SALT_A)))
    assert re.search(rf"reencode .* {total}/{total} pages", text), text  # the progress bar, as ingest shows it


def test_a_new_resolution_policy_is_reencoded_as_a_fresh_ingest_under_it_would_be(corpus, engine_settings,
                                                                                 tmp_path):
    policy = {"min_pixels": 28 * 28, "max_pixels": 224 * 224}  # another policy: other token counts
    fresh = tmp_path / "fresh"
    _ingest(_settings(engine_settings, fresh, SALT_A, **policy), [corpus.src])
    data = _copy(corpus.old, tmp_path / "data")
    env = _env(engine_settings, data, SALT_A, MMRAG_MIN_PIXELS=str(policy["min_pixels"]),
               MMRAG_MAX_PIXELS=str(policy["max_pixels"]))
    result = runner.invoke(app, ["reencode", "--json"], env=env)
    assert result.exit_code == 0, result.output
    before, after = _pages(_settings(engine_settings, corpus.old, SALT_A)), _pages(_settings(engine_settings, data,
                                                                                            SALT_A))
    assert after == _pages(_settings(engine_settings, fresh, SALT_A, **policy))
    assert all(after[p].image_tokens < before[p].image_tokens for p in before)


class FailingPut:
    """Fault injection: the wrapped store refuses its ``fail_at``-th put (1-based) as a full disk would."""

    def __init__(self, inner: FeatureStore, fail_at: int) -> None:
        self.inner, self.fail_at, self.puts = inner, fail_at, 0
        self.backend, self.stats = inner.backend, inner.stats
        self.failed: list[ImageKey] = []

    def put(self, key: ImageKey, value) -> None:
        self.puts += 1
        if self.puts == self.fail_at:
            self.failed.append(key)
            raise FeatureStoreError(f"injected: no space left on device for {key}")
        self.inner.put(key, value)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_page_whose_new_tokens_cannot_be_stored_keeps_its_old_key_and_is_reported(corpus, engine_settings,
                                                                                   tmp_path):
    data = _copy(corpus.old, tmp_path / "data")
    settings = _settings(engine_settings, data, SALT_B)
    before = _pages(settings)
    store = FailingPut(DiskFeatureStore(settings.storage.features_dir), fail_at=3)
    index = wiring.read_index(settings)
    try:
        reencoder = wiring.reencoder(settings, encoder=wiring.vision_encoder(settings, wiring.resolve_model(settings)),
                                     store=store, index=index)
        report = reencoder.run()
    finally:
        index.client.close()
    (failed,) = store.failed
    after = _pages(settings)
    refused = {pid for pid, p in before.items() if p.content_hash == failed.content_hash}
    assert refused and {(s.path, s.page) for s in report.skipped} == {(before[p].path, before[p].page) for p in refused}
    assert all("could not be stored" in s.reason and "injected" in s.reason for s in report.skipped)
    assert not DiskFeatureStore(settings.storage.features_dir).contains(failed)
    for page_id, page in after.items():
        if page_id in refused:
            assert page == before[page_id]  # its old key still names tokens that exist: still valid, not served
        else:
            assert corpus.scope_b.covers(page.image_key) and store.contains(page.image_key)
    assert report.reencoded == len(before) - len(refused)

    result = runner.invoke(app, ["reencode", "--json"], env=_env(engine_settings, data, SALT_B))  # the real store
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["reencoded"], out["encoded"], out["current"]) == (len(refused), 1, len(before) - len(refused))
    assert _pages(settings) == _pages(_settings(engine_settings, corpus.fresh, SALT_B))


def test_pages_of_a_changed_or_missing_file_are_left_untouched_and_reported(corpus, engine_settings, sample_corpus,
                                                                          tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    changed, kept, gone = "operations_manual.pdf", "q3_quarterly_report.pdf", "allhands_01_company_overview.png"
    for name in (changed, kept, gone):
        shutil.copy(sample_corpus / name, src)
    data = tmp_path / "data"
    _ingest(_settings(engine_settings, data, SALT_A), [src])
    before = _pages(_settings(engine_settings, data, SALT_A))
    shutil.copy(sample_corpus / "page_cache_paper.pdf", src / changed)  # other bytes under the same name
    (src / gone).unlink()

    result = runner.invoke(app, ["reencode", "--json"], env=_env(engine_settings, data, SALT_B))
    assert result.exit_code == 1, result.output  # some pages could not be re-encoded
    out = json.loads(result.stdout)
    after = _pages(_settings(engine_settings, data, SALT_B))
    by_doc: dict[str, list[str]] = {}
    for page_id, page in before.items():
        by_doc.setdefault(page.doc, []).append(page_id)
    for doc in (changed, gone):
        assert all(after[p] == before[p] for p in by_doc[doc])
    assert all(corpus.scope_b.covers(after[p].image_key) for p in by_doc[kept])
    skipped = {(Path(s["path"]).name, s["page"]): s["reason"] for s in out["skipped"]}
    assert set(skipped) == {(before[p].doc, before[p].page) for doc in (changed, gone) for p in by_doc[doc]}
    assert all(skipped[(changed, before[p].page)] == FILE_CHANGED for p in by_doc[changed])
    assert skipped[(gone, 1)] == f"{FILE_UNREADABLE}: no such file or directory: check the path"
    assert "mmrag ingest" in out["fix"] and out["reencoded"] == len(by_doc[kept])

    human = runner.invoke(app, ["reencode"], env=_env(engine_settings, data, SALT_B))
    text = " ".join(human.output.split())
    assert human.exit_code == 1 and f"{len(skipped)} pages not re-encoded" in text and "mmrag ingest PATH" in text


def test_pages_keyed_before_the_version_covered_preprocessing_are_reported_old_and_reencoded(
        corpus, engine_settings, sample_corpus, tmp_path, monkeypatch):
    """An index an mmrag from before wrote: the same checkpoint and settings, but keys whose encoder version hashes
    no preprocessing. `mmrag index check` names those pages old keys of this encoder, with `mmrag reencode` as the
    fix, and a re-encode makes every page current."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(sample_corpus / "allhands_01_company_overview.png", src)
    data = tmp_path / "data"
    settings = _settings(engine_settings, data, SALT_B)
    with monkeypatch.context() as before_preprocessing:  # what the encoder's version was then
        before_preprocessing.setattr(VisionCheckpoint, "version", VisionCheckpoint.version_before_preprocessing)
        _ingest(settings, [src])
    old = _pages(settings)
    assert old and not any(corpus.scope_b.covers(p.image_key) for p in old.values())
    env = _env(engine_settings, data, SALT_B)

    check = runner.invoke(app, ["index", "check", "--json"], env=env)
    assert check.exit_code == 1, check.output
    out = json.loads(check.stdout)
    (encoder,) = out["encoders"]
    assert encoder["old_format"] and not encoder["servable"] and encoder["pages"] == len(old)
    assert out["fix"].startswith("run `mmrag reencode`")
    human = " ".join(runner.invoke(app, ["index", "check"], env=env).output.split())
    assert f"{len(old)} pages carry keys this encoder minted before its version covered preprocessing" in human

    result = runner.invoke(app, ["reencode", "--json"], env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["reencoded"] == len(old)
    assert all(corpus.scope_b.covers(p.image_key) for p in _pages(settings).values())
    after = json.loads(runner.invoke(app, ["index", "check", "--json"], env=env).stdout)
    assert after["stale_pages"] == 0 and not any(e["old_format"] for e in after["encoders"])


def test_a_run_killed_half_way_and_rerun_ends_as_an_uninterrupted_run_and_a_third_is_a_no_op(
        corpus, engine_settings, tmp_path):
    # Batch size 1 in every run: the entries must match byte for byte, and batching may round differently.
    def env_for(data: Path) -> dict[str, str]:
        return _env(engine_settings, data, SALT_B, MMRAG_VISION_BATCH_SIZE="1")

    def cli(data: Path, *args: str) -> dict:  # a process of its own, as a user runs it
        return dict(args=[sys.executable, "-m", "mmrag", "reencode", *args], env=dict(os.environ, **env_for(data)),
                    cwd=REPO)

    reference, killed = _copy(corpus.old, tmp_path / "reference"), _copy(corpus.old, tmp_path / "killed")
    done = runner.invoke(app, ["reencode", "--json"], env=env_for(reference))  # uninterrupted, in this process
    assert done.exit_code == 0, done.output
    new_keys = {k for p in _pages(_settings(engine_settings, reference, SALT_B)).values() for k in p.image_keys}
    pattern = f"??/img1-*-{corpus.scope_b.version}-*.safetensors"

    proc = subprocess.Popen(**cli(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def three_stored() -> bool:
        if len(list((killed / "features").glob(pattern))) >= 3:
            return True
        if proc.poll() is not None:
            pytest.fail("the run finished before it could be killed; make the corpus larger")
        return False

    eventually_sync(three_stored, timeout=300, what="three new entries stored")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stored_at_kill = len(list((killed / "features").glob(pattern)))
    partial = _pages(_settings(engine_settings, killed, SALT_B))
    switched = sum(corpus.scope_b.covers(p.image_key) for p in partial.values())
    assert stored_at_kill < len(new_keys) and switched < len(partial), "the kill came after the last page"
    print(f"\nkilled with {stored_at_kill} of {len(new_keys)} new entries stored, {switched} of {len(partial)} "
          "pages switched")

    resumed = subprocess.run(**cli(killed, "--json"), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = json.loads(resumed.stdout)
    assert out["current"] == switched and out["reencoded"] == len(partial) - switched
    assert out["encoded"] == len(new_keys) - stored_at_kill  # no stored entry is encoded again

    assert _points(_settings(engine_settings, killed, SALT_B)) == _points(_settings(engine_settings, reference,
                                                                                    SALT_B))
    entries = {p.name: p.read_bytes() for p in (killed / "features").glob("??/*.safetensors")}
    assert entries == {p.name: p.read_bytes() for p in (reference / "features").glob("??/*.safetensors")}

    again = runner.invoke(app, ["reencode", "--json"], env=env_for(killed))
    assert again.exit_code == 0, again.output
    out = json.loads(again.stdout)
    assert (out["encoded"], out["reencoded"], out["current"]) == (0, 0, len(partial))


def test_reencode_into_redis_stores_the_new_tokens_there(corpus, engine_settings, redis_url, tmp_path):
    url = redis_url.rsplit("/", 1)[0] + "/9"  # a database of its own: other tests use /0, /7, /8
    store = RedisFeatureStore(url)
    store.client.flushdb()
    disk = DiskFeatureStore(corpus.old / "features")
    for key in disk.keys():
        store.put(key, disk.get(key))
    data = tmp_path / "data"
    shutil.copytree(corpus.old / "qdrant", data / "qdrant")
    result = runner.invoke(app, ["reencode", "--json"], env=_env(engine_settings, data, SALT_B, MMRAG_REDIS_URL=url))
    assert result.exit_code == 0, result.output
    pages = _pages(_settings(engine_settings, data, SALT_B))
    assert pages == _pages(_settings(engine_settings, corpus.fresh, SALT_B))
    assert all(store.contains(p.image_key) for p in pages.values())
    assert not (data / "features").exists() or not list((data / "features").glob("??/*"))  # nothing went to disk


def test_switching_to_the_pixels_form_gives_every_entry_its_pixels_without_a_forward(corpus, engine_settings,
                                                                                     tmp_path):
    """An index ingested in the embeds form stores tokens only; with MMRAG_IMAGE_INPUT=pixels, `mmrag reencode`
    adds to each entry (pages and figure crops) the lossless PNG of exactly the image its key names, with no
    vision forward and no key or payload changed, so the pixels form can serve the index as it is."""
    import io

    from PIL import Image

    from mmrag.core.engine import ImageInput
    from mmrag.core.keys import content_hash_of
    from serving.engine.images import ImageInputError, plan_form

    data = _copy(corpus.old, tmp_path / "data")
    settings = _settings(engine_settings, data, SALT_A)
    pages = _pages(settings)
    keys = sorted({k for p in pages.values() for k in p.image_keys}, key=str)
    store = DiskFeatureStore(settings.storage.features_dir)
    before = {k: store.get(k) for k in keys}
    assert all(store.has_pixels(k) is False and v.pixels_png is None for k, v in before.items())
    with pytest.raises(ImageInputError, match=re.escape(WITHOUT_PIXELS_FIX)):
        plan_form(ImageInput.PIXELS, keys[:1], [before[keys[0]]])
    env = _env(engine_settings, data, SALT_A, MMRAG_IMAGE_INPUT="pixels")

    def index_check() -> dict:
        result = runner.invoke(app, ["index", "check", "--json"], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    check = index_check()
    assert check["without_pixels"] == len(pages) and "MMRAG_IMAGE_INPUT=pixels" in check["fix"]
    dry = runner.invoke(app, ["reencode", "--dry-run", "--json"], env=env)
    assert dry.exit_code == 0, dry.output
    dry = json.loads(dry.stdout)
    assert (dry["to_reencode"], dry["encoded"], dry["without_pixels"]) == (0, 0, len(pages))
    assert all(store.has_pixels(k) is False for k in keys)  # a dry run writes nothing

    done = runner.invoke(app, ["reencode", "--json"], env=env)
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout)
    assert (out["reencoded"], out["encoded"], out["skipped"]) == (0, 0, [])  # no vision forward
    assert out["without_pixels"] == len(pages) and out["pixels_added"] == len(keys)  # a shared figure once
    assert _pages(settings) == pages  # the same keys and payloads
    after = {k: store.get(k) for k in keys}
    for key, value in after.items():
        assert torch.equal(value.image_tokens, before[key].image_tokens)
        assert torch.equal(value.grid_thw, before[key].grid_thw)
        with Image.open(io.BytesIO(value.pixels_png)) as png:
            image = png.convert("RGB")
        assert content_hash_of(image.mode, image.size, image.tobytes()) == key.content_hash  # the key's image
    assert plan_form(ImageInput.PIXELS, keys, [after[k] for k in keys]) is ImageInput.PIXELS
    check = index_check()
    assert check["without_pixels"] == 0 and check["fix"] == ""

    again = runner.invoke(app, ["reencode"], env=env)  # nothing left to do, and the summary says nothing of it
    assert again.exit_code == 0 and "entries lacked them" not in again.output, again.output
