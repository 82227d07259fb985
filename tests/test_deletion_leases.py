"""Deleting a document, or `mmrag store gc`, never breaks what is running: answers hold leases on the pages and
images they show until their last token, conversations on their images while they live (issue 24, item 4).
Tokens that did go (a lease that lapsed, then a gc) answer "send the image again", never "re-ingest".

On the real app and the session engine, over a feature store of this module's own (a copy of the session's,
which the session engine reads while the module runs): its deletions and its gc touch no other test's entries.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageDraw, ImageFont
from rich.console import Console

from mmrag.adapters.store import DiskFeatureStore, StoreLease
from mmrag.core.keys import ImageKey
from mmrag import store_cmd
from serving.api.conversations import (Conversations, ImagesExpiredError, QuestionImage,
                                        UnknownConversationError)
from tests.conftest import API_KEY, copy_corpus, serving
from tests.waiting import ingest_finished

AUTH = {"Authorization": f"Bearer {API_KEY}"}
STREAMS = 8


def page_png() -> bytes:
    """A page no store holds yet (a random mark): its entry is this test's own to delete."""
    image = Image.new("RGB", (448, 448), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=32)  # large enough that OCR reads it: the page's text for retrieval
    draw.text((20, 30), "quarterly report", fill="black", font=font)
    draw.text((20, 80), uuid.uuid4().hex[:12], fill="black", font=font)
    draw.rectangle((60, 160, 380, 400), outline="black", width=3)
    return _png(image)


def small_png() -> bytes:
    """A small question image no store holds yet (56 x 56 px: the fewest pixels the processor takes)."""
    return _png(Image.frombytes("RGB", (56, 56), os.urandom(56 * 56 * 3)))


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> dict:
    return {"data": base64.b64encode(data).decode()}


async def upload(http: httpx.AsyncClient, name: str, body: bytes) -> dict:
    """An image uploaded and ingested (POST /v1/documents, its job awaited): its doc id and its one page."""
    r = await http.post("/v1/documents", files={"file": (name, body, "image/png")})
    assert r.status_code == 202, r.text
    out = r.json()
    job = await ingest_finished(http, out["job"]["id"], timeout=120)
    assert job["status"] == "done" and job["report"]["pages"] == 1, job
    doc = next(d for d in (await http.get("/v1/documents")).json()["documents"] if d["doc_id"] == out["doc_id"])
    page = (await http.get(f"/v1/pages/{doc['pages'][0]['page_id']}")).json()
    return {"doc_id": out["doc_id"], "page_id": page["id"], "key": ImageKey.parse(page["image_key"])}


@asynccontextmanager
async def own_store_app(engine_settings, inprocess_engine, data: Path, **settings_update):
    """The app on ``data`` (a copy of the session's index and entries), the session engine reading that copy's
    entries meanwhile; yields (url, app, settings, store)."""
    from mmrag.wiring import create_app

    copy_corpus(engine_settings, data)
    settings = engine_settings.replace(**{"data_dir": data, "warm_top": 0, **settings_update})
    store = DiskFeatureStore(settings.storage.features_dir)
    session_store = inprocess_engine.features.store
    inprocess_engine.features.store = store
    try:
        app = create_app(settings, engine=inprocess_engine, store=store)
        async with serving(app) as url:
            yield url, app, settings, store
    finally:
        inprocess_engine.features.store = session_store


@pytest.fixture(scope="module")
async def leases(engine_settings, ingested, inprocess_engine, tmp_path_factory):
    # Answers of exactly 48 tokens (a benchmark knob, read by the wiring in the development profile): long enough
    # that a deletion lands while they are being generated. OCR: a page's words are what a question finds it by.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MMRAG_ANSWER_FIXED_LENGTH", "true")  # for this module's app, built and serving in the block
        async with own_store_app(engine_settings, inprocess_engine, tmp_path_factory.mktemp("leases-data"),
                                 ocr=True, api_key=API_KEY, answer_max_tokens=48) as (url, app, s, store):
            assert app.state.services.pipeline.config.fixed_length
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
                yield {"http": http, "app": app, "settings": s, "store": store, "tmp": tmp_path_factory}


def gc_beside_the_server(settings, tmp: Path) -> store_cmd.GcReport:
    """`mmrag store gc --apply` while the server runs, over the server's own feature store. Qdrant's local mode
    lets one client hold a folder, so the gc reads a copy of the server's index (with a Qdrant server,
    MMRAG_QDRANT_URL, it would read the index itself)."""
    shutil.copytree(settings.storage.qdrant_path, tmp / "qdrant", ignore=shutil.ignore_patterns(".lock"))
    (tmp / "features").symlink_to(settings.storage.features_dir, target_is_directory=True)
    return store_cmd.gc(settings.replace(**{"data_dir": tmp}), dry_run=False)


async def test_deleting_a_document_while_answers_that_cite_it_stream_ends_none_of_them(leases):
    """The probe's reproduction: 8 streamed questions cite one document, deleted while they stream."""
    http = leases["http"]
    doc = await upload(http, "report.png", page_png())
    cited, finished = asyncio.Event(), []
    citing = 0

    async def ask(i: int) -> list[tuple[str, dict]]:
        nonlocal citing
        events = []
        body = {"question": f"What does report number {i} show?", "docs": [doc["doc_id"]], "stream": True}
        async with http.stream("POST", "/v1/ask", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for event in _events(r):
                events.append(event)
                if event[0] == "citations":
                    citing += 1
                    if citing == STREAMS:
                        cited.set()
        finished.append(i)
        return events

    streams = [asyncio.create_task(ask(i)) for i in range(STREAMS)]
    async with asyncio.timeout(120):
        await cited.wait()  # every answer has its page: retrieval is done, its lease taken
    done_before = len(finished)
    t0 = time.monotonic()
    deleted = await http.delete(f"/v1/documents/{doc['doc_id']}")
    delete_s = time.monotonic() - t0
    streaming_at_delete = STREAMS - done_before
    assert deleted.status_code == 200, deleted.text
    results = await asyncio.gather(*streams)

    for events in results:
        names = [name for name, _ in events]
        assert "error" not in names and names[-1] == "done", events[-1]
        answer = events[-1][1]["answer"]
        assert [c["page_id"] for c in answer["citations"]] == [doc["page_id"]], answer["answer"]
    assert streaming_at_delete >= 1  # the deletion came while answers were still being generated
    listed = (await http.get("/v1/documents", params={"limit": 1000})).json()["documents"]
    assert doc["doc_id"] not in {d["doc_id"] for d in listed}
    gone = await http.post("/v1/ask", json={"question": "What does the report show?", "docs": [doc["doc_id"]]})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "unknown_document", gone.text
    assert (await http.get(f"/v1/pages/{doc['page_id']}")).status_code == 404
    print(f"\n{STREAMS} streams citing one document, deleted after all had their citations: "
          f"{STREAMS} of {STREAMS} ended with `done`, {streaming_at_delete} were still generating when DELETE was "
          f"sent; DELETE took {delete_s * 1000:.0f} ms")


async def test_a_conversation_keeps_its_image_through_a_deletion_of_the_same_pixels_and_a_gc(leases):
    http, store = leases["http"], leases["store"]
    figure = page_png()
    doc = await upload(http, "figure.png", figure)
    first = await http.post("/v1/ask", json={"question": "What does this figure show?", "images": [b64(figure)]})
    assert first.status_code == 200, first.text
    conversation = first.json()["conversation_id"]
    (image,) = first.json()["question_images"]
    assert ImageKey.parse(image["image_key"]) == doc["key"]  # the question's image is the page's entry

    assert (await http.delete(f"/v1/documents/{doc['doc_id']}")).status_code == 200
    report = await asyncio.to_thread(gc_beside_the_server, leases["settings"], leases["tmp"].mktemp("gc"))
    assert report.leased >= 1 and doc["key"] not in {k for k, _ in report.unreferenced}
    console = Console(record=True, width=400)
    store_cmd.print_gc(report, console)
    assert f"leased: {report.leased}" in console.export_text() and report.to_json()["leased"] == report.leased
    assert store.size(doc["key"])  # unreferenced now, but the conversation holds it

    follow = await http.post("/v1/ask", json={"question": "And its caption?", "conversation_id": conversation})
    assert follow.status_code == 200, follow.text
    assert follow.json()["usage"]["vision_encodes"] == 0 and follow.json()["question_images"] == [image]


async def test_an_image_whose_lease_lapsed_and_was_collected_says_send_it_again(leases):
    http, store = leases["http"], leases["store"]
    sent = small_png()
    first = await http.post("/v1/ask", json={"question": "What does this show?", "images": [b64(sent)]})
    assert first.status_code == 200, first.text
    conversation = first.json()["conversation_id"]
    key = ImageKey.parse(first.json()["question_images"][0]["image_key"])
    # The conversation's lease lapses (as one of a killed server does: its end, the file's mtime, passes) ...
    held = list((leases["settings"].storage.features_dir / ".leases" / str(key)).iterdir())
    assert held and all(f.name.startswith("conversation-") for f in held)
    for lease in held:
        os.utime(lease, (time.time() - 1, time.time() - 1))
    # ... and a gc removes the entry.
    report = await asyncio.to_thread(gc_beside_the_server, leases["settings"], leases["tmp"].mktemp("gc"))
    assert key in {k for k, _ in report.unreferenced} and store.size(key) is None

    follow = await http.post("/v1/ask", json={"question": "And its colours?", "conversation_id": conversation})
    assert follow.status_code == 409, follow.text
    error = follow.json()["error"]
    assert error["type"] == "image_expired" and "send the images again" in error["fix"], error
    assert "ingest" not in (error["message"] + error["fix"]).lower(), error
    again = await http.post("/v1/ask", json={"question": "And its colours?", "conversation_id": conversation,
                                             "images": [b64(sent)]})
    assert again.status_code == 200, again.text
    assert again.json()["conversation_id"] == conversation and again.json()["usage"]["vision_encodes"] == 1


async def _events(response: httpx.Response):
    """(event name, data) of each server-sent event, as each arrives."""
    name = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield name, json.loads(line.removeprefix("data: "))


# --- the conversation table's leases, on a disk store of the test's own ------------------------------------


def _image(n: int) -> QuestionImage:
    return QuestionImage(ImageKey.parse(f"img1-{n:064x}-{'ab' * 8}-px1-2"), n)


async def test_a_conversation_leases_its_images_until_it_expires_or_is_evicted(tmp_path):
    store = DiskFeatureStore(tmp_path)
    now = [0.0]
    table = Conversations(max_entries=10, per_tenant=1, ttl_s=10, clock=lambda: now[0],
                          lease=lambda: StoreLease(store, "conversation", 10))
    a = await table.remember([_image(1), _image(2)])
    assert store.leased(_image(1).key) and store.leased(_image(2).key)
    await table.remember([_image(3)])  # a's tenant is over its bound: a goes, and its lease with it
    assert not store.leased(_image(1).key) and store.leased(_image(3).key)
    now[0] = 11
    b = await table.remember([_image(4)], tenant="other")  # the first, last used at 0, expires here
    assert not store.leased(_image(3).key) and store.leased(_image(4).key)
    with pytest.raises(ImagesExpiredError, match="send the images again"):
        await table.recall(b, tenant="other")  # its entry was never stored
    assert len(table) == 0 and not store.leased(_image(4).key)  # forgotten, its lease ended
    with pytest.raises(UnknownConversationError):
        await table.recall(a)
