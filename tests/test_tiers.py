"""Resolution tiers: named policies in Settings, each its own key; ingestion encodes the configured ones; a
question asking for a tier gets its pages encoded on demand (one vision forward each, counted), or served in
the nearest stored tier when the page cannot be rendered; an unknown tier is a clear 400 / CLI error."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from PIL import Image
from qdrant_client import QdrantClient

from mmrag.adapters.store import DiskFeatureStore
from mmrag.adapters.vision import VisionEncoder
from mmrag.core.keys import ImageKey, ResolutionPolicy, Tiers, UnknownTierError
from mmrag.core.payload import PagePayload
from mmrag.core.settings import Settings
from mmrag import wiring
from rag.tiers import PageTiers
from retrieval.search import Hit
from tests.conftest import API_KEY

REPO = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = "What does the architecture diagram show?"


def page_tiers(settings, store, encoder_for) -> PageTiers:
    """PageTiers as the composition root builds it: the settings' tiers and document section."""
    return PageTiers(settings.vision.tier_table, settings.documents, store, encoder_for)


def test_the_default_tiers_keep_standard_as_todays_policy_and_name_every_key(monkeypatch):
    monkeypatch.delenv("MMRAG_MAX_PIXELS")  # the default bound (tests/conftest.py lowers it for the session)
    settings = Settings()
    tiers = settings.vision.tier_table
    assert list(tiers.policies) == ["standard", "low", "high"]
    assert tiers.policy("standard") == settings.vision.resolution_policy == ResolutionPolicy(56 * 56, 448 * 448)
    assert tiers.policy("low").pooled and not tiers.policy("high").pooled
    assert settings.ingest_tier_policies == []  # ingestion encodes standard only by default
    key = ImageKey.parse(f"img1-{'a' * 64}-{'b' * 16}-px3136-200704")
    assert tiers.labels(key) == {"tier": "standard", "pooled": "false"}
    assert tiers.labels(key.in_policy(tiers.policy("low"))) == {"tier": "low", "pooled": "true"}
    assert tiers.labels(key.in_policy(ResolutionPolicy(1, 2))) == {"tier": "other", "pooled": "false"}
    with pytest.raises(UnknownTierError, match="configured tiers: standard, low, high"):
        tiers.policy("ultra")


def test_the_default_low_and_high_tiers_follow_the_configured_standard_bounds(monkeypatch):
    monkeypatch.setenv("MMRAG_MAX_PIXELS", str(224 * 224))
    settings = Settings()
    assert settings.vision.tiers == {"low": ResolutionPolicy(3136, 224 * 224, pool=2),
                                     "high": ResolutionPolicy(3136, 4 * 224 * 224)}
    assert Settings(min_pixels=28 * 28).vision.tiers["low"] == ResolutionPolicy(28 * 28, 224 * 224, pool=2)
    # A copy with other bounds: tiers that followed the bounds follow them; set ones stay.
    moved = settings.replace(max_pixels=448 * 448)
    assert moved.vision.tiers == {"low": ResolutionPolicy(3136, 448 * 448, pool=2),
                                  "high": ResolutionPolicy(3136, 896 * 896)}
    set_ones = settings.replace(tiers={"tiny": {"min_pixels": 3136, "max_pixels": 12544}})
    assert set_ones.replace(max_pixels=448 * 448).vision.tiers == {"tiny": ResolutionPolicy(3136, 12544)}
    monkeypatch.setenv("MMRAG_TIERS", '{"tiny": {"min_pixels": 3136, "max_pixels": 12544}}')
    assert Settings().vision.tiers == {"tiny": ResolutionPolicy(3136, 12544)}  # MMRAG_TIERS as set, no default


def test_settings_of_variables_read_those_variables_and_defaults_not_the_environment(monkeypatch):
    monkeypatch.setenv("MMRAG_MAX_PIXELS", str(224 * 224))
    monkeypatch.setenv("MMRAG_TOP_K", "9")
    monkeypatch.setenv("MMRAG_TIERS", '{"tiny": {"min_pixels": 3136, "max_pixels": 12544}}')
    given = Settings.of_variables({"MMRAG_TOP_K": "5", "MMRAG_ANSWER_FIXED_LENGTH": "true", "HOME": "/root"})
    assert given.retrieval.top_k == 5 and given.vision.resolution_policy == ResolutionPolicy(3136, 448 * 448)
    assert set(given.vision.tiers) == {"low", "high"}  # the defaults, for the default bounds
    small = Settings.of_variables({"MMRAG_MAX_PIXELS": str(112 * 112)})
    assert small.vision.tiers["low"] == ResolutionPolicy(3136, 112 * 112, pool=2)
    assert small.retrieval.top_k == Settings.of_variables({}).retrieval.top_k != 9


def test_a_page_in_another_configured_tier_counts_as_in_use_for_garbage_collection():
    tiers = Settings().vision.tier_table
    indexed = ImageKey.parse(f"img1-{'a' * 64}-{'b' * 16}-px3136-200704")
    in_use = tiers.in_use([indexed])
    assert in_use(indexed) and in_use(indexed.in_policy(tiers.policy("low")))
    assert not in_use(indexed.in_policy(ResolutionPolicy(1, 2)))  # a tier no longer configured: garbage
    assert not in_use(dataclasses.replace(indexed, encoder_version="c" * 16).in_policy(tiers.policy("low")))
    assert not in_use(dataclasses.replace(indexed, content_hash="d" * 64))


def test_tier_settings_are_validated_with_the_fix(monkeypatch):
    monkeypatch.setenv("MMRAG_TIERS", '{"tiny": {"min_pixels": 3136, "max_pixels": 12544, "pool": 2}}')
    monkeypatch.setenv("MMRAG_INGEST_TIERS", "standard, tiny")
    assert Settings().ingest_tier_policies == [ResolutionPolicy(3136, 12544, pool=2)]
    monkeypatch.setenv("MMRAG_INGEST_TIERS", "standard,low")
    with pytest.raises(ValueError, match="unknown resolution tier 'low'; configured tiers: standard, tiny"):
        Settings()
    monkeypatch.setenv("MMRAG_TIERS", '{"standard": {"min_pixels": 3136, "max_pixels": 12544}}')
    with pytest.raises(ValueError, match="set those instead"):
        Settings()


def test_the_nearest_tier_compares_tokens_per_page_pooling_included():
    standard, low, high = (ResolutionPolicy(3136, 200704), ResolutionPolicy(3136, 200704, pool=2),
                           ResolutionPolicy(3136, 802816))
    assert Tiers.nearest(high, [low, standard]) == standard
    assert Tiers.nearest(low, [standard, high]) == standard
    assert Tiers.nearest(standard, [low, high]) == high  # as far in tokens both ways: the one losing no detail


# --- ingestion ------------------------------------------------------------------------------------------


def test_ingestion_encodes_the_configured_tiers_once_and_a_new_tier_makes_a_file_not_current(
        engine_settings, sample_corpus, tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    for name in ("operations_manual.pdf", "allhands_03_platform.png"):
        shutil.copy(sample_corpus / name, files / name)
    base = engine_settings.replace(**{"data_dir": tmp_path / "data", "ingest_tiers": ["standard", "low"]})
    ingestor = wiring.ingestor(base)
    try:
        first = ingestor.run([files])
        again = ingestor.run([files])
        points, _ = ingestor.index.client.scroll(base.storage.qdrant_collection, limit=100, with_payload=True)
    finally:
        ingestor.index.client.close()
    keys = {PagePayload.from_qdrant(p.payload).image_key for p in points}
    low = base.vision.tier_table.policy("low")
    assert not first.failed and first.encoded == 2 * len(keys)  # one forward per page per tier
    assert again.encoded == 0 and again.unchanged_files == 2
    assert all(k.policy == base.vision.resolution_policy for k in keys)  # the index carries standard keys
    store = wiring.feature_store(base)
    assert all(store.contains(k.in_policy(low)) for k in keys)

    more = wiring.ingestor(base.replace(**{"ingest_tiers": ["standard", "low", "high"]}))
    try:
        third = more.run([files])
    finally:
        more.index.client.close()
    high = base.vision.tier_table.policy("high")
    assert third.unchanged_files == 0 and third.encoded == len(keys)  # only the new tier's forwards
    assert all(store.contains(k.in_policy(high)) for k in keys)


# --- on-demand encoding and fallback ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hits(engine_settings, ingested) -> list[Hit]:
    """Two distinct indexed pages as retrieval returns them."""
    client = QdrantClient(path=str(engine_settings.storage.qdrant_path))
    try:
        points, _ = client.scroll(engine_settings.storage.qdrant_collection, limit=1000, with_payload=True)
    finally:
        client.close()
    pages = {p.image_key: p for p in (PagePayload.from_qdrant(x.payload) for x in points)}
    return [Hit.of(pages[k], 1.0, QUESTION) for k in sorted(pages)[:2]]


@pytest.fixture(scope="module")
def encoder(tiny_model, engine_settings) -> VisionEncoder:
    return VisionEncoder(tiny_model, engine_settings.vision.resolution_policy)


async def test_a_page_missing_in_the_asked_tier_is_encoded_on_demand_once(engine_settings, hits, encoder, tmp_path):
    store = DiskFeatureStore(tmp_path / "features")  # empty: no page is stored in any tier yet
    tiers = page_tiers(engine_settings, store, encoder.with_policy)
    high = engine_settings.vision.tier_table.policy("high")
    first = await tiers([hits], "high")
    again = await tiers([hits[:1]], "high")
    assert first.vision_encodes == 2 and first.fell_back == [] and again.vision_encodes == 0
    got = first.hits[0]
    assert [h.image_key for h in got] == [h.image_key.in_policy(high) for h in hits]
    assert all(store.get(h.image_key).num_tokens == h.image_tokens for h in got)
    assert again.hits[0][0] == got[0]
    assert got[0].image_tokens > hits[0].image_tokens  # more pixels, more tokens
    assert (await tiers([hits], "standard")).hits == [hits]  # the tier they are indexed in: as they are
    print(f"\nhigh tier on demand: {[h.image_tokens for h in hits]} -> {[h.image_tokens for h in got]} tokens")


async def test_tokens_encoded_on_demand_are_keyed_by_the_encoder_that_made_them(engine_settings, hits, tiny_model,
                                                                                 tmp_path):
    """The tier encoder here is another encoder than the one that indexed the pages (another salt, as after an
    upgrade): what it makes is stored, and served, under its own version, never under the index's."""
    store = DiskFeatureStore(tmp_path / "features")
    other = VisionEncoder(tiny_model, engine_settings.vision.resolution_policy, salt="another-encoder")
    assert other.version != hits[0].image_key.encoder_version
    high = other.with_policy(engine_settings.vision.tier_table.policy("high"))
    got = await page_tiers(engine_settings, store, other.with_policy)([hits], "high")
    assert got.vision_encodes == len(hits)
    assert [h.image_key for h in got.hits[0]] == [high.key_for(h.image_key.content_hash) for h in hits]
    assert set(store.keys()) == {high.key_for(h.image_key.content_hash) for h in hits}


async def test_a_figure_shown_as_its_crop_is_cropped_again_and_encoded_on_demand_in_the_asked_tier(
        engine_settings, ingested, encoder, tmp_path):
    """MMRAG_FIGURE_CROPS shows a figure hit as its crop (rag/plans.shown_as_figures): a crop missing in the asked
    tier is cropped from its page again, encoded once under the crop's own key, not refused as a changed page."""
    from ingestion.loaders import render_page
    from rag.plans import shown_as_figures

    client = QdrantClient(path=str(engine_settings.storage.qdrant_path))
    try:
        points, _ = client.scroll(engine_settings.storage.qdrant_collection, limit=1000, with_payload=True)
    finally:
        client.close()
    pages = [PagePayload.from_qdrant(x.payload) for x in points]
    page = next(p for p in sorted(pages, key=lambda p: (p.doc, p.page)) if p.figures and p.figures[0].region.number)
    figure = page.figures[0]
    question = f"What does {figure.label} show?"
    (shown,), = shown_as_figures([[dataclasses.replace(Hit.of(page, 1.0, question), figure=figure)]], [question])
    assert shown.image_key == figure.image_key  # the crop, not the page
    store = DiskFeatureStore(tmp_path / "features")
    got = await page_tiers(engine_settings, store, encoder.with_policy)([[shown]], "high")
    high = encoder.with_policy(engine_settings.vision.tier_table.policy("high"))
    assert got.fell_back == [] and got.vision_encodes == 1
    (tiered,), = got.hits
    assert tiered.image_key == high.key_for(figure.image_key.content_hash) and tiered.figure == figure
    crop = next(c for c in render_page(Path(page.path), page.page, engine_settings.documents).figures
                if c.content_hash == figure.image_key.content_hash)
    assert store.get(tiered.image_key).num_tokens == tiered.image_tokens == high.num_tokens_for(crop.image)
    assert tiered.image_key.policy != figure.image_key.policy


async def test_a_page_whose_source_is_gone_falls_back_to_the_nearest_stored_tier(engine_settings, hits, encoder,
                                                                                 tmp_path):
    store = DiskFeatureStore(tmp_path / "features")
    hit = hits[0]
    low = engine_settings.vision.tier_table.policy("low")
    rendered = encoder.with_policy(low)
    moved = dataclasses.replace(hit, path=str(tmp_path / "gone.pdf"))
    tiers = page_tiers(engine_settings, store, encoder.with_policy)
    only_indexed = await tiers([[moved]], "low")  # nothing stored in any tier: the indexed key, as it was
    assert only_indexed.hits == [[moved]] and only_indexed.vision_encodes == 0
    assert only_indexed.fell_back == [f"[{hit.doc}, page {hit.page}]: standard (its source file cannot be opened: "
                                      f"{_missing_message(moved)})"]
    with pytest.raises(FileNotFoundError):
        Path(moved.path).stat()
    # With the low tier stored (an earlier ingest), a high question falls back to standard, the nearer of the two.
    store.put(hit.image_key, wiring.feature_store(engine_settings).get(hit.image_key))
    store.put(hit.image_key.in_policy(low), rendered.encode([_image_of(engine_settings, hit)])[0])
    served = await tiers([[moved]], "high")
    assert served.hits[0][0].image_key == hit.image_key and served.vision_encodes == 0
    assert (await tiers([[moved]], "low")).hits[0][0].image_key == hit.image_key.in_policy(low)  # stored: used


def _missing_message(hit: Hit) -> str:
    from ingestion.loaders import IngestError, open_document

    try:
        open_document(Path(hit.path), Settings().documents)
    except IngestError as exc:
        return str(exc)
    raise AssertionError("the moved file exists")


def _image_of(settings: Settings, hit: Hit):
    from ingestion.loaders import open_document

    with open_document(Path(hit.path), settings.documents) as doc:
        return next(p for p in doc.pages() if p.page == hit.page).image


# --- through the API and the CLI -------------------------------------------------------------------------


@pytest.fixture
async def http(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=300, headers=AUTH) as client:
        yield client


@pytest.fixture
def drop_low_tier_entries(api_server):
    """The session store is every test's: the low-tier entries a question here encodes go again afterwards (other
    tests count the store's entries against the index's pages)."""
    store = api_server["app"].state.services.store
    before = set(store.keys())
    yield
    for key in set(store.keys()) - before:
        store.delete(key)


@pytest.mark.parametrize("mode", ["joint", "split"])
async def test_a_question_in_the_low_tier_encodes_its_pages_once_and_takes_a_quarter_of_the_image_tokens(
        http, drop_low_tier_entries, mode):
    standard = (await http.post("/v1/ask", json={"question": QUESTION, "answer_mode": mode})).json()
    first = (await http.post("/v1/ask", json={"question": QUESTION, "tier": "low", "answer_mode": mode})).json()
    again = (await http.post("/v1/ask", json={"question": QUESTION, "tier": "low", "answer_mode": mode})).json()
    # Either strategy in the tier as in the standard one (a split over one image, such as the same slide in two
    # decks cited twice, is one prompt: the joint one).
    assert standard["answer_mode"] == first["answer_mode"] in ({"joint"} if mode == "joint" else {"split", "joint"})
    assert "tier" not in standard and first["tier"] == {"name": "low", "fell_back": []}
    assert first["usage"]["vision_encodes"] >= 1 and again["usage"]["vision_encodes"] == 0
    assert [c["page_id"] for c in first["citations"]] == [c["page_id"] for c in standard["citations"]]
    assert again["usage"]["image_tokens"] == first["usage"]["image_tokens"]
    assert 3 * first["usage"]["image_tokens"] <= standard["usage"]["image_tokens"]
    print(f"\nimage tokens: standard {standard['usage']['image_tokens']}, low (pooled) "
          f"{first['usage']['image_tokens']}; on-demand forwards {first['usage']['vision_encodes']}, then 0")


async def test_question_images_tier_encodes_and_ingest_jobs_run_one_tower(api_server):
    """A served process holds one copy of the vision weights (wiring.vision_tower), whoever encodes first; a
    question's image count is its own view's, so an ingest job's forwards never show in a question's usage.
    Built off the loop, as the server builds them: an ingestor's index writes through the server's own loop."""
    import asyncio

    services = api_server["app"].state.services
    question = await asyncio.to_thread(services.question_images._make_encoder)
    tier = await asyncio.to_thread(services.pipeline.tiers._encoder_for, services.settings.tiers.policy("low"))
    ingest = (await asyncio.to_thread(services.jobs.jobs._make_ingestor, "default", ())).encoder
    assert question.tower is tier.tower is ingest.tower
    assert question is not ingest and question.forwards == 0  # a view: the count of its own
    before = ingest.forwards
    await asyncio.to_thread(ingest.encode, [Image.new("RGB", (56, 56), "white")])
    assert question.forwards == 0 and ingest.forwards == before + 1


async def test_an_unknown_tier_is_a_400_naming_the_configured_tiers(http):
    response = await http.post("/v1/ask", json={"question": QUESTION, "tier": "ultra"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "unknown_tier" and "standard, low, high" in error["message"] and error["fix"]
    upload = await http.post("/v1/ask/upload", data={"question": QUESTION, "tier": "ultra"})
    assert upload.status_code == 400 and upload.json()["error"]["type"] == "unknown_tier"


@pytest.mark.parametrize("args", [["ask", QUESTION, "--tier", "ultra"], ["ingest", "nowhere.pdf", "--tier", "ultra"]])
def test_the_cli_refuses_an_unknown_tier_naming_the_configured_ones(args, engine_settings):
    env = dict(os.environ, MMRAG_DATA_DIR=str(engine_settings.storage.data_dir), MMRAG_MODEL=engine_settings.model.name,
               HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "mmrag", *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2, done.stderr
    assert "--tier: unknown resolution tier 'ultra'; configured tiers: standard, low, high" in " ".join(
        done.stderr.split())


async def test_a_document_may_ask_for_a_tier_and_its_deletion_takes_the_tiers_entries_too(http, api_server):
    from tests.test_tenants import _png
    from tests.waiting import ingest_finished

    store = api_server["app"].state.services.store
    low = api_server["settings"].vision.tier_table.policy("low")
    r = await http.post("/v1/documents", files={"file": ("tiered.png", _png("tiered"), "image/png")},
                        data={"tiers": ["ultra"]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "unknown_tier", r.text
    r = await http.post("/v1/ingest", json={"paths": ["x"], "tiers": ["ultra"]})
    assert r.status_code == 400 and "low" in r.json()["error"]["message"], r.text

    r = await http.post("/v1/documents", files={"file": ("tiered.png", _png("tiered"), "image/png")},
                        data={"tiers": ["low"]})
    assert r.status_code == 202 and r.json()["job"]["tiers"] == ["low"], r.text
    job = await ingest_finished(http, r.json()["job"]["id"], timeout=300)  # a hang guard
    assert job["status"] == "done" and job["report"]["encoded"] == 2, job  # standard, then low
    doc = next(d for d in (await http.get("/v1/documents", params={"limit": 1000})).json()["documents"]
               if d["doc_id"] == r.json()["doc_id"])
    key = ImageKey.parse((await http.get(f"/v1/pages/{doc['pages'][0]['page_id']}")).json()["image_key"])
    assert store.contains(key) and store.contains(key.in_policy(low))
    deleted = (await http.delete(f"/v1/documents/{doc['doc_id']}")).json()
    assert deleted["pages"] == 1, deleted
    assert not store.contains(key) and not store.contains(key.in_policy(low))


async def test_the_openai_route_takes_a_tier_as_an_extra_field(api_server, drop_low_tier_entries):
    import openai

    client = openai.AsyncOpenAI(base_url=api_server["url"] + "/v1", api_key=API_KEY, timeout=300, max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    standard = await client.chat.completions.create(model="mmrag", messages=messages)
    low = await client.chat.completions.create(model="mmrag", messages=messages, extra_body={"tier": "low"})
    assert low.model_extra["citations"] == standard.model_extra["citations"]
    # A quarter of the image tokens (or fewer: a pooled page is resized to whole 2x2 squares), the text the same.
    assert 0 < 4 * low.usage.image_tokens <= standard.usage.image_tokens
    assert standard.usage.prompt_tokens - low.usage.prompt_tokens == \
        standard.usage.image_tokens - low.usage.image_tokens
    with pytest.raises(openai.BadRequestError, match="unknown_tier"):
        await client.chat.completions.create(model="mmrag", messages=messages, extra_body={"tier": "ultra"})
    await client.close()
