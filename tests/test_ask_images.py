"""Questions with images (POST /v1/ask, /v1/ask/upload) on the session's real server and engine: each image is
encoded once, leads every prompt of its question, and a follow-up in the same conversation gets its KV from the
prefix cache without a vision forward; bad images and a vision service that is down get a 4xx / 503 that says
what to do, while questions without images keep working."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import random

import httpx
import pytest
from PIL import Image, ImageDraw

from mmrag.core.engine import PromptPlan
from mmrag.core.keys import ImageKey
from serving.api.conversations import Conversations, QuestionImage, UnknownConversationError
from serving.api.services import QuestionImages
from tests.conftest import API_KEY, free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TWO_PART = "What does this figure show and what is the retry limit of the ingest service?"


@pytest.fixture
async def http(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=300, headers=AUTH) as client:
        yield client


def new_figure(size: tuple[int, int] = (280, 280)) -> bytes:
    """A PNG no earlier run has encoded (random boxes), small enough for the plain body limit."""
    rng = random.Random()
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = rng.randrange(size[0] - 40), rng.randrange(size[1] - 40)
        draw.rectangle((x, y, x + 40, y + 30), fill=tuple(rng.randrange(256) for _ in range(3)))
    return _png(image)


def b64(data: bytes) -> dict:
    return {"data": base64.b64encode(data).decode()}


def image_prefix_bound(services, key: ImageKey, tokens: int) -> int:
    """Image tokens of ``key`` a prompt that starts with it must get from the prefix cache when an earlier one
    did: the full KV blocks up to its end, less what comes before it (the system prompt)."""
    engine = services.engine.inner
    layout = engine.renderer.tokens(engine.renderer.render(PromptPlan((key,), "any question")), [tokens])
    (start, n), = layout.image_spans
    block = engine.llm.vllm_config.cache_config.block_size
    return (start + n) // block * block - start


@pytest.mark.parametrize("mode", ["joint", "split"])
async def test_a_follow_up_gets_the_images_kv_from_the_prefix_cache_and_runs_no_vision_forward(http, api_server,
                                                                                              mode):
    services = api_server["app"].state.services
    await services.engine.reset_prefix_cache()
    first = await http.post("/v1/ask", json={"question": TWO_PART, "images": [b64(new_figure())], "answer_mode": mode})
    assert first.status_code == 200, first.text
    one = first.json()
    assert one["usage"]["vision_encodes"] == 1 and one["conversation_id"] and one["answer_mode"] == mode
    (image,) = one["question_images"]
    key, tokens = ImageKey.parse(image["image_key"]), image["image_tokens"]
    assert tokens == 100  # 280 x 280 px: 20 x 20 patches of 14, merged 2 x 2
    bound = image_prefix_bound(services, key, tokens)
    assert bound >= 64
    if mode == "split":  # a part per page, every part's prompt led by the question's image: the later parts hit
        assert len(one["image_answers"]) >= 2 and one["usage"]["cached_image_tokens"] >= bound  # the first's KV
    else:  # at 8 answer tokens a joint answer is one prompt (a part is rag/plans.JOINT_PART_MIN_TOKENS at least)
        assert "image_answers" not in one
    prompts = len(one.get("image_answers", [None]))

    follow = await http.post("/v1/ask", json={"question": "What is the input of its third module?",
                                              "conversation_id": one["conversation_id"], "answer_mode": mode})
    assert follow.status_code == 200, follow.text
    two = follow.json()
    assert two["usage"]["vision_encodes"] == 0
    assert two["conversation_id"] == one["conversation_id"] and two["question_images"] == one["question_images"]
    assert two["usage"]["cached_image_tokens"] >= len(two.get("image_answers", [None])) * bound
    print(f"\n{mode}: question image: {tokens} tokens, {bound} in full KV blocks after the system prompt; cold "
          f"question: {one['usage']['cached_image_tokens']}/{one['usage']['image_tokens']} image tokens cached over "
          f"{prompts} prompt(s), {one['usage']['vision_encodes']} forward; follow-up: "
          f"{two['usage']['cached_image_tokens']}/{two['usage']['image_tokens']} cached, 0 forwards")


async def test_the_same_image_uploaded_as_a_file_has_the_same_key_and_is_not_encoded_again(http):
    figure = new_figure()
    sent = (await http.post("/v1/ask", json={"question": "What does it show?", "images": [b64(figure)]})).json()
    r = await http.post("/v1/ask/upload", data={"question": "What does it show?"},
                        files=[("images", ("fig.png", figure, "image/png")), ("images", ("same.png", figure, "image/png"))])
    assert r.status_code == 200, r.text
    up = r.json()
    assert sent["usage"]["vision_encodes"] == 1 and up["usage"]["vision_encodes"] == 0
    assert up["question_images"] == sent["question_images"]  # the same picture twice is one image
    assert up["conversation_id"] != sent["conversation_id"]  # each question with images starts its own


async def test_pages_make_room_for_the_images_lowest_score_first_and_say_so(http, api_server):
    limit = api_server["settings"].engine.max_images_per_prompt
    room = 2
    images = [b64(new_figure((196 + 28 * i, 196))) for i in range(limit - room)]
    r = await http.post("/v1/ask", json={"question": "What is the retry limit of the ingest service?",
                                         "images": images, "answer_mode": "joint"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["citations"]) == room and body["pages_left_out"]  # top_k = 3 pages, room for 2
    cited = {f"[{c['doc']}, page {c['page']}]" for c in body["citations"]}
    assert not cited & set(body["pages_left_out"])
    # Each prompt (the joint answer's parts, each over every image) shows the question's images and the 2 pages.
    prompts = len(body.get("image_answers") or [None])
    pages = [(await http.get(f"/v1/pages/{c['page_id']}")).json()["image_tokens"] for c in body["citations"]]
    assert body["usage"]["image_tokens"] == prompts * (sum(i["image_tokens"] for i in body["question_images"])
                                                       + sum(pages))


async def test_a_question_without_images_has_no_conversation(http):
    body = (await http.post("/v1/ask", json={"question": "What is the retry limit of the ingest service?",
                                             "answer_mode": "joint"})).json()  # every retrieved page shown
    assert not {"conversation_id", "question_images", "pages_left_out"} & body.keys()


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("images, status, kind, names", [
    ([{"data": "not base64!"}], 400, "invalid_image", "base64"),
    ([{"data": "data:image/png,abc"}], 400, "invalid_image", ";base64"),
    ([b64(b"GIF89a not an image we read")], 400, "invalid_image", "PNG, JPEG, WebP or TIFF"),
    ([b64(b"\x89PNG\r\n\x1a\n truncated")], 400, "invalid_image", "damaged or truncated"),
    ([b64(b"%PDF-1.7 a pdf")], 400, "invalid_image", "PDF"),
    ([b64(b"x")] * 5, 400, "too_many_images", "MMRAG_MAX_QUESTION_IMAGES"),
])
async def test_bad_images_get_a_4xx_that_names_the_fix(http, images, status, kind, names):
    r = await http.post("/v1/ask", json={"question": "What does it show?", "images": images})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and names in err["message"] + err["fix"], err


@contextlib.contextmanager
def question_images(services, images: QuestionImages):
    """The running server's question images replaced (another encoder or limits) for one test."""
    saved, services.question_images = services.question_images, images
    try:
        yield
    finally:
        services.question_images = saved


async def test_an_image_over_the_pixel_or_byte_limit_is_a_413_naming_it(http, api_server):
    services = api_server["app"].state.services
    small = dataclasses.replace(services.settings, documents=dataclasses.replace(
        services.settings.documents, max_image_pixels=100 * 100, max_image_bytes=2_000))
    with question_images(services, QuestionImages(small, services.store, lambda: pytest.fail("no encoder needed"))):
        noise = Image.frombytes("RGB", (60, 30), random.randbytes(60 * 30 * 3))  # ~5 kB: it does not compress
        for data, limit in [(_png(Image.new("RGB", (120, 100), "white")), "MMRAG_MAX_IMAGE_PIXELS"),
                            (_png(noise), "MMRAG_MAX_IMAGE_BYTES"),
                            # 2,000 pixels, but the model takes it only padded to 2000 x 10, over the bound
                            (_png(Image.new("RGB", (2000, 1), "black")), "aspect ratio over 200:1")]:
            r = await http.post("/v1/ask", json={"question": "What does it show?", "images": [b64(data)]})
            assert r.status_code == 413 and r.json()["error"]["type"] == "image_too_large", r.text
            assert limit in r.json()["error"]["message"]


def long_png(size: tuple[int, int]) -> bytes:
    """A line of random colours past the vision processor's 200:1 aspect ratio (a receipt, a banner, a rule)."""
    return _png(Image.frombytes("RGB", size, random.randbytes(size[0] * size[1] * 3)))


@pytest.mark.parametrize("size", [(10_000, 1), (3, 20_000)], ids=["wide", "tall"])
async def test_an_image_past_the_processors_aspect_ratio_is_fitted_and_answered_on_every_route(http, size):
    """Issue 41: a 1 x 10000 image answered 500 from the processor's resize on every route. It is padded to a
    ratio the processor takes (ingestion/raster.py), so each route answers about it."""
    from ingestion.raster import fitted_size

    png = long_png(size)
    body = {"question": "What does this strip show?", "max_tokens": 2}
    r = await http.post("/v1/ask", json={**body, "images": [b64(png)]})
    assert r.status_code == 200, r.text
    (image,) = r.json()["question_images"]
    assert image["image_tokens"] > 0 and max(fitted_size(*size)) / min(fitted_size(*size)) <= 200
    up = await http.post("/v1/ask/upload", data={"question": body["question"], "max_tokens": "2"},
                         files=[("images", ("strip.png", png, "image/png"))])
    assert up.status_code == 200 and up.json()["question_images"] == r.json()["question_images"], up.text
    async with http.stream("POST", "/v1/ask", json={**body, "images": [b64(png)], "stream": True}) as streamed:
        events = [line async for line in streamed.aiter_lines() if line.startswith("event: ")]
    assert streamed.status_code == 200 and events[-1] == "event: done" and "event: error" not in events
    content = [{"type": "text", "text": body["question"]},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}]
    chat = {"model": "mmrag", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    c = await http.post("/v1/chat/completions", json=chat)
    assert c.status_code == 200 and c.json()["choices"][0]["message"]["content"], c.text
    async with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as chunks:
        lines = [line async for line in chunks.aiter_lines() if line.startswith("data: ")]
    assert chunks.status_code == 200 and lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)


async def test_an_unknown_conversation_is_a_404_that_says_to_send_the_images_again(http):
    r = await http.post("/v1/ask", json={"question": "And its third module?", "conversation_id": "never-started"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_conversation", r.text
    assert "send the images again" in r.json()["error"]["message"]


async def test_the_vision_service_down_fails_questions_with_images_only(http, api_server):
    # The real client of the vision service, pointed at a port nothing listens on.
    from mmrag.adapters.vision_client import RemoteVisionEncoder

    services = api_server["app"].state.services
    down = f"http://127.0.0.1:{free_port()}"
    with question_images(services, QuestionImages(services.settings, services.store,
                                                  lambda: RemoteVisionEncoder(down, timeout_s=5))):
        r = await http.post("/v1/ask", json={"question": "What does it show?", "images": [b64(new_figure())]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "vision_unavailable", r.text
        assert down in r.json()["error"]["message"] and "MMRAG_VISION_URL" in r.json()["error"]["message"]
        plain = await http.post("/v1/ask", json={"question": "What is the retry limit of the ingest service?"})
        assert plain.status_code == 200, plain.text


async def test_the_body_limit_grows_by_the_images_on_the_question_routes_only(http, api_server):
    settings = api_server["settings"]
    big = new_figure((448, 448)) + b"\0" * settings.api.max_request_bytes  # PNG readers ignore bytes after IEND
    r = await http.post("/v1/ask", json={"question": "What does it show?", "images": [b64(big)]})
    assert r.status_code == 200, r.text
    up = await http.post("/v1/ask/upload", data={"question": "What does it show?"},
                         files=[("images", ("big.png", big, "image/png"))])
    assert up.status_code == 200, up.text
    url = "data:image/png;base64," + b64(big)["data"]
    chat = await http.post("/v1/chat/completions", json={"model": "mmrag", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What does it show?"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    assert chat.status_code == 200, chat.text
    elsewhere = await http.post("/v1/ingest", json={"paths": ["x" * len(big)]})
    assert elsewhere.status_code == 413 and "MMRAG_MAX_REQUEST_BYTES" in elsewhere.json()["error"]["fix"]


# --- the conversation store --------------------------------------------------------------------------------


def _image(n: int) -> QuestionImage:
    return QuestionImage(ImageKey.parse(f"img1-{n:064x}-{'ab' * 8}-px1-2"), n)


async def test_conversations_expire_after_their_last_use_and_the_least_recently_used_go_first():
    now = [0.0]
    store = Conversations(max_entries=2, per_tenant=2, ttl_s=10, clock=lambda: now[0])
    a, b = await store.remember([_image(1)]), await store.remember([_image(2)])
    now[0] = 8
    assert await store.recall(a) == (_image(1),)  # used: alive until 18
    c = await store.remember([_image(3)], "chosen-id")  # full: b, the least recently used, goes
    assert c == "chosen-id" and len(store) == 2
    with pytest.raises(UnknownConversationError, match="send the images again"):
        await store.recall(b)
    now[0] = 17.9
    assert await store.recall(a) == (_image(1),)
    now[0] = 27
    with pytest.raises(UnknownConversationError):
        await store.recall(c)  # last used at 8
    assert await store.recall(a) == (_image(1),) and len(store) == 1  # last used at 17.9
