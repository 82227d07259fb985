"""`mmrag serve` in the pixels form (MMRAG_IMAGE_INPUT=pixels) end to end: the sample corpus ingested in that form
(pages stored with their pixels), questions answered through the REST app with the pages' pixels sent to vLLM
under their keys; the same answers as the embeds form over the same corpus, and each answer and /metrics say
which form served it. Ingestion without tokens (MMRAG_INGEST_IMAGE_TOKENS=false) runs no tower forward.

Both apps share the session's in-process engine (one vLLM), each in its own form over its own copy of the corpus.
"""

from __future__ import annotations

import time

import httpx
import pytest

from mmrag.core.engine import ImageInput
from mmrag import wiring
from serving.engine.features import FeatureProvider
from serving.metrics import parse_samples, sample_total
from tests.conftest import API_KEY, copy_corpus, serving
from tests.test_ask_images import b64, new_figure

pytestmark = pytest.mark.engine
AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTIONS = ["What is the layered architecture?", "How does the system work, and what does the chart show?"]


@pytest.fixture(scope="module")
def pixels_corpus(engine_settings, ingested, sample_corpus, tmp_path_factory):
    """The sample corpus ingested in the pixels form, and a copy of it (the embeds app's: Qdrant local mode lets
    one client open a folder)."""
    settings = engine_settings.replace(**{
        "data_dir": tmp_path_factory.mktemp("pixels-data"), "image_input": "pixels", "api_key": API_KEY,
        "answer_max_tokens": 8, "warm_top": 0})
    started = time.perf_counter()
    ingestor = wiring.ingestor(settings)
    try:
        report = ingestor.run([sample_corpus])
    finally:
        ingestor.index.client.close()
    print(f"\npixels-form ingest: {report.pages} pages in {time.perf_counter() - started:.1f} s")
    assert not report.failed and (report.encoded, report.pages) == (ingested.encoded, ingested.pages)
    copy = engine_settings.replace(**{"data_dir": tmp_path_factory.mktemp("embeds-copy"), "api_key": API_KEY,
                                              "answer_max_tokens": 8, "warm_top": 0})
    copy_corpus(settings, copy.storage.data_dir)
    return {"pixels": settings, "embeds": copy}


def app_in(form: ImageInput, settings, engine):
    store = wiring.feature_store(settings)
    view = engine.with_image_input(form)
    view.features = FeatureProvider.unscoped(store)  # the app's own corpus, questions' images included
    return wiring.create_app(settings, engine=view, store=store)


@pytest.fixture(scope="module")
async def two_forms(pixels_corpus, inprocess_engine):
    async with (serving(app_in(ImageInput.PIXELS, pixels_corpus["pixels"], inprocess_engine)) as px_url,
                serving(app_in(ImageInput.EMBEDS, pixels_corpus["embeds"], inprocess_engine)) as em_url,
                httpx.AsyncClient(base_url=px_url, headers=AUTH, timeout=120) as pixels,
                httpx.AsyncClient(base_url=em_url, headers=AUTH, timeout=120) as embeds):
        yield {"pixels": pixels, "embeds": embeds}


def test_every_page_entry_of_a_pixels_form_ingest_holds_its_pixels_and_its_tokens(pixels_corpus):
    store = wiring.feature_store(pixels_corpus["pixels"])
    entries = [store.get(k) for k in store.keys()]
    assert entries and all(e.pixels_png and e.has_tokens for e in entries)


@pytest.mark.parametrize("mode", ["auto", "joint", "split"])
async def test_the_pixels_form_answers_as_the_embeds_form_and_says_so(two_forms, inprocess_engine, mode):
    answers = []
    for question in QUESTIONS:  # in either strategy, and as auto chooses
        await inprocess_engine.reset_prefix_cache()
        px = await two_forms["pixels"].post("/v1/ask", json={"question": question, "answer_mode": mode})
        em = await two_forms["embeds"].post("/v1/ask", json={"question": question, "answer_mode": mode})
        assert px.status_code == em.status_code == 200, (px.text, em.text)
        px, em = px.json(), em.json()
        assert px["answer"] == em["answer"] and px["citations"] == em["citations"]
        assert px["answer_mode"] == em["answer_mode"] and px.get("image_answers") == em.get("image_answers")
        assert (px["usage"]["image_input"], em["usage"]["image_input"]) == ("pixels", "embeds")
        assert px["usage"]["image_tokens"] == em["usage"]["image_tokens"] > 0
        answers.append(px)
    # Asked again in the pixels form: its pages' KV is served from the prefix cache, the answer the same.
    again = (await two_forms["pixels"].post("/v1/ask", json={"question": QUESTIONS[-1], "answer_mode": mode})).json()
    assert again["usage"]["cached_image_tokens"] > 0 and again["answer"] == answers[-1]["answer"]
    metrics = parse_samples((await two_forms["pixels"].get("/metrics")).text)
    name = "mmrag_engine_requests_by_image_input_total"
    assert sample_total(metrics, name, form="pixels") >= len(QUESTIONS) + 1
    assert sample_total(metrics, name, form="embeds") == 0


async def test_a_question_image_is_sent_as_pixels_too(two_forms):
    body = {"question": "What does it show?", "images": [b64(new_figure())]}
    px = (await two_forms["pixels"].post("/v1/ask", json=body)).json()
    em = (await two_forms["embeds"].post("/v1/ask", json=body)).json()
    assert px["usage"]["image_input"] == "pixels" and px["answer"] == em["answer"]
    assert px["question_images"] == em["question_images"]  # one key for the picture, whichever form


def test_a_pixels_only_ingest_runs_no_tower_forward(engine_settings, sample_corpus, tmp_path):
    settings = engine_settings.replace(**{"data_dir": tmp_path, "image_input": "pixels",
                                                  "ingest_image_tokens": False})
    one = sorted(sample_corpus.glob("*.pdf"))[0]
    ingestor = wiring.ingestor(settings)
    try:
        report = ingestor.run([one])
    finally:
        ingestor.index.client.close()
    assert not report.failed and report.pages > 0 and report.encoded == 0
    store = wiring.feature_store(settings)
    entries = [store.get(k) for k in store.keys()]
    assert entries and all(e.pixels_png and not e.has_tokens and e.num_tokens > 0 for e in entries)
