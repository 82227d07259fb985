"""The vision feature service (`mmrag vision serve`): the in-process encoder's keys and tokens over HTTP, shared
forwards across callers, and its refusals. The main tests talk to the real process (conftest vision_server)."""

from __future__ import annotations

from dataclasses import replace
import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from mmrag.adapters.store import DiskFeatureStore
from mmrag.adapters.vision import VisionEncoder
from mmrag.adapters.vision_client import RemoteVisionEncoder, VisionServiceInfo, png_bytes, unpack_tokens
from mmrag.core.keys import ContentHash, EncoderVersion, ResolutionPolicy
from mmrag.core.settings import Settings
from ingestion.loaders import ImageTooLargeError, decode_image, image_content_hash
from mmrag import wiring
from tests.conftest import free_port, serving
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[1]
_seed = iter(range(1000, 100_000))  # every call of new_images draws images no other test has sent


def new_images(sizes: list[tuple[int, int]]) -> list[Image.Image]:
    rng = np.random.default_rng(next(_seed))
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def upload(images: list[Image.Image]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("images", (f"{i}.png", png_bytes(im), "image/png")) for i, im in enumerate(images)]


def local_settings(tiny_model: Path, data_dir: Path, **update) -> Settings:
    return Settings(model=str(tiny_model), data_dir=data_dir, vision_device="cpu", vision_dtype="float32",
                    ocr=False, **update)


@pytest.fixture(scope="module")
def local_encoder(tiny_model, tmp_path_factory):
    """The in-process encoder the service must agree with."""
    settings = local_settings(tiny_model, tmp_path_factory.mktemp("local-vision"))
    return wiring.vision_encoder(settings, wiring.resolve_model(settings))


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    return sample(httpx.get(f"{url}/metrics").text, name, labels)


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    from serving.metrics import parse_samples

    found = [v for have, v in parse_samples(text).get(name, []) if (labels or {}).items() <= have.items()]
    assert found, f"{name} {labels or ''} not in /metrics"
    return found[0]


def test_info_names_the_in_process_encoders_version_and_encoder_scope_asks_the_service(
        vision_server, local_encoder, tiny_model, tmp_path):
    info = httpx.get(f"{vision_server['url']}/v1/info").json()
    assert info == {"encoder_version": local_encoder.version,
                    "policy": {"min_pixels": local_encoder.policy.min_pixels,
                               "max_pixels": local_encoder.policy.max_pixels, "pool": 1},
                    "family": "qwen2_vl", "device": "cpu", "dtype": "float32"}
    # With MMRAG_VISION_URL the scope is the service's, even where this host would compute another one
    # (a salt here that the service does not use).
    remote = local_settings(tiny_model, tmp_path, vision_url=vision_server["url"], encoder_salt="not-the-services")
    scope = wiring.encoder_scope(remote, wiring.resolve_model(remote))
    assert (scope.version, scope.policy) == (local_encoder.version, local_encoder.policy)
    assert httpx.get(f"{vision_server['url']}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{vision_server['url']}/readyz").json()["ready"] is True


def test_the_info_round_trips_a_pooled_policy():
    pooled = ResolutionPolicy(3136, 200704, pool=2)
    info = VisionServiceInfo(EncoderVersion("ab" * 8), pooled, "qwen2_vl", "cpu", "float32")
    body = json.loads(json.dumps(info.to_json()))
    assert body["policy"] == {"min_pixels": 3136, "max_pixels": 200704, "pool": 2}
    assert VisionServiceInfo.of_json(body) == info


async def test_a_pooled_services_info_keeps_pool_so_the_client_mints_the_services_keys(tiny_model, tmp_path,
                                                                                      monkeypatch):
    """A pooled key differs from the unpooled one (-pool2): a client that dropped ``pool`` would key pages under a
    policy the service never encodes, and find none of its tokens."""
    settings = local_settings(tiny_model, tmp_path)
    pooled = ResolutionPolicy(settings.vision.min_pixels, settings.vision.max_pixels, pool=2)
    encoder = VisionEncoder(tiny_model, pooled)
    monkeypatch.setattr(wiring.vision, "local_vision_encoder", lambda _settings, _model: encoder)
    async with serving(wiring.vision_app(settings)) as url:
        body = (await asyncio.to_thread(httpx.get, f"{url}/v1/info")).json()
        client = await asyncio.to_thread(RemoteVisionEncoder, url)
    try:
        assert body["policy"]["pool"] == 2 and client.policy == pooled
        content = ContentHash("ab" * 32)
        assert client.key_for(content) == encoder.key_for(content)
    finally:
        client.close()


def test_with_the_service_down_at_start_up_the_scope_is_computed_here_with_a_warning(tiny_model, tmp_path, caplog):
    # The API must still start (questions without images are answered): it serves what its own settings give.
    down = local_settings(tiny_model, tmp_path, vision_url=f"http://127.0.0.1:{free_port()}", encoder_salt="here")
    model = wiring.resolve_model(down)
    with caplog.at_level("WARNING", logger="mmrag.wiring"):
        scope = wiring.encoder_scope(down, model)
    assert scope == wiring.encoder_scope(down.replace(**{"vision_url": ""}), model)
    assert "unreachable" in caplog.text and "MMRAG_VISION_DEVICE=" in caplog.text


def test_the_store_path_stores_the_in_process_encoders_tokens_under_its_keys(vision_server, local_encoder):
    images = new_images([(448, 448), (500, 300), (60, 100)])
    answer = httpx.post(f"{vision_server['url']}/v1/encode", files=upload(images), timeout=60)
    assert answer.status_code == 200, answer.text
    store = DiskFeatureStore(vision_server["data_dir"] / "features")
    expected = local_encoder.encode(images)
    for image, described, value in zip(images, answer.json()["images"], expected, strict=True):
        key = local_encoder.key_for(image_content_hash(image))
        assert described == {"key": str(key), "tokens": value.num_tokens, "grid_thw": value.grid_thw[0].tolist(),
                             "source": "forward"}
        stored = store.get(key)
        assert torch.equal(stored.image_tokens, value.image_tokens) and torch.equal(stored.grid_thw, value.grid_thw)


def test_the_binary_path_returns_the_in_process_encoders_tokens(vision_server, local_encoder):
    images = new_images([(448, 448), (200, 600), (100, 60)])
    client = RemoteVisionEncoder(vision_server["url"])
    remote = client.encode(images)
    assert client.forwards == 3
    for image, got, want in zip(images, remote, local_encoder.encode(images), strict=True):
        assert torch.equal(got.image_tokens, want.image_tokens) and torch.equal(got.grid_thw, want.grid_thw)
        assert client.num_tokens_for(image) == local_encoder.num_tokens_for(image)
        assert client.key_for(image_content_hash(image)) == local_encoder.key_for(image_content_hash(image))
    # The same images again come from the store: no forward, same bytes, through the query flag too.
    again = httpx.post(f"{vision_server['url']}/v1/encode?tokens=true", files=upload(images), timeout=60)
    entries = unpack_tokens(again.content)
    assert [e.source for e in entries] == ["store"] * 3
    assert all(torch.equal(e.value.image_tokens, r.image_tokens) for e, r in zip(entries, remote))


def _ingest(paths: list[Path], data_dir: Path, tiny_model: Path, vision_url: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "MMRAG_MODEL": str(tiny_model), "MMRAG_DATA_DIR": str(data_dir), "MMRAG_OCR": "false",
           "MMRAG_VISION_DEVICE": "cpu", "MMRAG_VISION_DTYPE": "float32", "MMRAG_VISION_URL": vision_url}
    env.pop("MMRAG_REDIS_URL", None)
    return subprocess.run([sys.executable, "-m", "mmrag", "ingest", "--json", *map(str, paths)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def small_corpus(sample_corpus, tmp_path_factory) -> list[Path]:
    """A PDF (several pages) and a PNG slide of the sample corpus, in a folder of their own."""
    folder = tmp_path_factory.mktemp("small-corpus")
    return [Path(shutil.copy(sample_corpus / name, folder))
            for name in ("design_review_ingest_v2.pdf", "allhands_02_q3_revenue.png")]


def _indexed_keys(data_dir: Path, tiny_model: Path) -> dict[tuple[str, int], tuple[str, ...]]:
    """Per page, the entries it references: its image's and its figures' crops'."""
    index = wiring.read_index(local_settings(tiny_model, data_dir))
    try:
        return {(p.doc, p.page): tuple(map(str, p.image_keys)) for p in index.pages()}
    finally:
        index.client.close()


def test_ingest_through_the_service_gives_the_same_keys_and_tokens_as_in_process(
        vision_server, small_corpus, tiny_model, tmp_path):
    forwards = metric(vision_server["url"], "mmrag_vision_forwards_total")
    local = _ingest(small_corpus, tmp_path / "local", tiny_model)
    remote = _ingest(small_corpus, tmp_path / "remote", tiny_model, vision_server["url"])
    reports = [json.loads(p.stdout.strip().splitlines()[-1]) for p in (local, remote)]
    assert [p.returncode for p in (local, remote)] == [0, 0], remote.stderr[-2000:]
    assert reports[0]["pages"] == reports[1]["pages"] == reports[1]["encoded"] > 2
    assert metric(vision_server["url"], "mmrag_vision_forwards_total") == (
        forwards + reports[1]["encoded"] + reports[1]["figures_encoded"])  # pages and figure crops
    keys = _indexed_keys(tmp_path / "local", tiny_model)
    assert keys == _indexed_keys(tmp_path / "remote", tiny_model) and len(keys) == reports[0]["pages"]
    stores = [DiskFeatureStore(tmp_path / name / "features") for name in ("local", "remote")]
    service_store = DiskFeatureStore(vision_server["data_dir"] / "features")
    assert sorted(map(str, stores[0].keys())) == sorted(map(str, stores[1].keys())) == sorted(
        {k for ks in keys.values() for k in ks})
    for key in stores[0].keys():
        ours, theirs, services = stores[0].get(key), stores[1].get(key), service_store.get(key)
        assert torch.equal(ours.image_tokens, theirs.image_tokens) and torch.equal(ours.grid_thw, theirs.grid_thw)
        assert torch.equal(ours.image_tokens, services.image_tokens)  # the shared-store path holds them too


async def test_concurrent_callers_share_a_batch(vision_server):
    url = vision_server["url"]
    batches, small = (metric(url, "mmrag_vision_batch_size_count"),
                      metric(url, "mmrag_vision_batch_size_bucket", {"le": "1.0"}))
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.gather(*(client.post(f"{url}/v1/encode", files=upload([im]))
                                         for im in new_images([(120, 120)] * 6)))
    assert [a.json()["images"][0]["source"] for a in answers] == ["forward"] * 6
    new_batches = metric(url, "mmrag_vision_batch_size_count") - batches
    single = metric(url, "mmrag_vision_batch_size_bucket", {"le": "1.0"}) - small
    assert new_batches < 6 and single < new_batches, "no forward held more than one caller's image"


async def test_two_requests_for_the_same_new_image_run_one_forward(vision_server):
    url = vision_server["url"]
    (image,) = new_images([(300, 200)])
    forwards = metric(url, "mmrag_vision_forwards_total")
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.gather(*(client.post(f"{url}/v1/encode", files=upload([image])) for _ in range(2)))
    assert metric(url, "mmrag_vision_forwards_total") == forwards + 1
    described = [a.json()["images"][0] for a in answers]
    assert sorted(d.pop("source") for d in described) == ["forward", "shared"]
    assert described[0] == described[1]  # the same key, tokens and grid


def test_malformed_bytes_are_refused_with_400_that_says_what_to_send(vision_server, sample_corpus):
    pdf = (sample_corpus / "design_review_ingest_v2.pdf").read_bytes()[:2000]
    for data in (b"not an image at all", png_bytes(new_images([(50, 50)])[0])[:200], pdf):
        answer = httpx.post(f"{vision_server['url']}/v1/encode", files=[("images", ("x.png", data, "image/png"))])
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_image" and "PNG" in error["message"] + error["fix"]


def test_an_oversize_image_is_refused_with_413_naming_the_limit(vision_server):
    data = b"\x89PNG\r\n\x1a\n" + bytes(vision_server["max_image_bytes"])
    answer = httpx.post(f"{vision_server['url']}/v1/encode", files=[("images", ("big.png", data, "image/png"))])
    assert answer.status_code == 413
    assert answer.json()["error"]["type"] == "image_too_large"
    assert "MMRAG_MAX_IMAGE_BYTES" in answer.json()["error"]["message"]


def test_decode_image_bounds_pixels_and_hashes_as_ingestion_does(tmp_path, tiny_model):
    settings = local_settings(tiny_model, tmp_path)
    (image,) = new_images([(100, 100)])
    with pytest.raises(ImageTooLargeError, match="MMRAG_MAX_IMAGE_PIXELS"):
        decode_image(png_bytes(image), replace(settings.documents, max_image_pixels=99 * 99))
    # An RGBA upload is composited over white exactly as an ingested RGBA file is.
    rgba = image.convert("RGBA")
    rgba.putalpha(128)
    out = io.BytesIO()
    rgba.save(out, format="PNG")
    (tmp_path / "slide.png").write_bytes(out.getvalue())
    from ingestion.loaders import open_document

    with open_document(tmp_path / "slide.png", settings.documents) as doc:
        (page,) = doc.pages()
    decoded = decode_image(out.getvalue(), settings.documents)
    assert image_content_hash(decoded) == page.content_hash


def _small_queue_app(tiny_model: Path, data_dir: Path):
    """A second service, in this process: one image may wait at a time, and a batch waits 1.5 s for a second."""
    settings = local_settings(tiny_model, data_dir, vision_queue_cap=1, vision_max_batch=2, vision_max_wait_ms=1500)
    return wiring.vision_app(settings)


async def test_a_full_queue_answers_429_with_retry_after(tiny_model, tmp_path):
    app = _small_queue_app(tiny_model, tmp_path)
    first, second = new_images([(64, 64), (80, 80)])
    async with serving(app) as url, httpx.AsyncClient(timeout=60) as client:
        waiting = asyncio.create_task(client.post(f"{url}/v1/encode", files=upload([first])))

        async def queued() -> bool:
            if waiting.done():
                pytest.fail(f"the first image was answered before it was seen queued: {waiting.result().text}")
            return sample((await client.get(f"{url}/metrics")).text, "mmrag_vision_queued_images") >= 1

        await eventually(queued, timeout=60, what="the first image queued")
        refused = await client.post(f"{url}/v1/encode", files=upload([second]))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "vision_queue_full"
        assert (await waiting).status_code == 200  # the queued caller is served all the same
        assert sample((await client.get(f"{url}/metrics")).text, "mmrag_vision_refused_images_total") == 1


async def test_the_service_going_down_fails_the_files_being_ingested_and_indexes_nothing(
        tiny_model, tmp_path, small_corpus):
    app = _small_queue_app(tiny_model, tmp_path / "service")
    async with serving(app) as url:
        settings = local_settings(tiny_model, tmp_path / "ingest", vision_url=url)
        ingestor = await asyncio.to_thread(wiring.ingestor, settings)  # the service answers /v1/info
    report = ingestor.run(small_corpus)  # ... and is gone by the time pages are encoded
    try:
        assert sorted(Path(f.path).name for f in report.failed) == sorted(p.name for p in small_corpus)
        assert all("vision service" in f.error and "unreachable" in f.error for f in report.failed)
        assert ingestor.index.count() == 0 and report.pages == 0
    finally:
        ingestor.index.client.close()


def test_mmrag_ingest_with_the_service_unreachable_exits_with_the_cause_and_writes_nothing(
        small_corpus, tiny_model, tmp_path):
    done = _ingest(small_corpus, tmp_path / "data", tiny_model, f"http://127.0.0.1:{free_port()}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "unreachable" in done.stderr and "MMRAG_VISION_URL" in done.stderr
    assert not (tmp_path / "data" / "qdrant").exists() and not (tmp_path / "data" / "features").exists()

