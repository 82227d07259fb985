"""Conversations are bounded per tenant: no tenant can push out another's (issue 24, item 2). The probe's
reproduction was tenant A's conversation lost to tenant B's 1,100 image chats; chats return no conversation id,
so they now make none, and a tenant over its bound (MMRAG_CONVERSATIONS_PER_TENANT) loses its own least recently
used conversation, never another tenant's."""

from __future__ import annotations

import httpx
import pytest

from mmrag.core.keys import ImageKey
from serving.api.conversations import Conversations, QuestionImage, UnknownConversationError
from serving.api.tenants import add_key
from tests.test_deletion_leases import b64, own_store_app, page_png, small_png, upload

BOUND = 2  # each tenant's conversations in the app below


def _image(n: int) -> QuestionImage:
    return QuestionImage(ImageKey.parse(f"img1-{n:064x}-{'ab' * 8}-px1-2"), n)


# --- the table ----------------------------------------------------------------------------------------------


async def test_a_tenants_1100_conversations_push_out_only_its_own():
    table = Conversations(max_entries=1024, per_tenant=1024, ttl_s=3600)
    a = await table.remember([_image(1)], tenant="a")
    for n in range(1100):
        await table.remember([_image(n + 2)], tenant="b")
    assert await table.recall(a, tenant="a") == (_image(1),)
    assert len(table) == 1024 and table.held_by("b") == 1023  # over the total, the tenant holding the most lost


async def test_a_tenant_over_its_bound_loses_its_own_least_recently_used():
    table = Conversations(max_entries=100, per_tenant=2, ttl_s=3600)
    a = await table.remember([_image(1)], tenant="a")
    b1, b2 = await table.remember([_image(2)], tenant="b"), await table.remember([_image(3)], tenant="b")
    await table.recall(b1, tenant="b")  # b2 is now b's least recently used
    await table.remember([_image(4)], tenant="b")
    assert table.held_by("b") == 2 and await table.recall(b1, tenant="b") == (_image(2),)
    with pytest.raises(UnknownConversationError, match="2 per tenant"):
        await table.recall(b2, tenant="b")
    assert await table.recall(a, tenant="a") == (_image(1),)


# --- on the real app ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def two_tenants(engine_settings, ingested, inprocess_engine, tmp_path_factory):
    """A ("default": the session corpus) and B ("globex": one page of its own), at most BOUND conversations each."""
    data = tmp_path_factory.mktemp("conversations-data")
    tenants_file = tmp_path_factory.mktemp("conversations-tenants") / "tenants.json"
    keys = {t: add_key(tenants_file, t) for t in ("default", "globex")}
    async with own_store_app(engine_settings, inprocess_engine, data, tenants_file=tenants_file,
                             answer_max_tokens=1, conversations_per_tenant=BOUND) as (url, app, settings, store):
        clients = {t: httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {k}"}, timeout=120)
                   for t, k in keys.items()}
        try:
            await upload(clients["globex"], "b.png", page_png())
            yield {"http": clients, "table": app.state.services.conversations.conversations}
        finally:
            for client in clients.values():
                await client.aclose()


def chat_with(image: bytes) -> dict:
    url = "data:image/png;base64," + b64(image)["data"]
    return {"model": "mmrag", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What does it show?"}, {"type": "image_url", "image_url": {"url": url}}]}]}


async def test_another_tenants_image_chats_and_questions_never_evict_a_tenants_conversation(two_tenants):
    """The probe's reproduction, at this app's bound: A asks with an image; B sends image chats (they make no
    conversation at all, so 1,100 of them would prove no more than these) and then BOUND + 100 image questions,
    each a conversation of its own (one real answer each: 1,100 would take minutes on 2 cores)."""
    a, b = two_tenants["http"]["default"], two_tenants["http"]["globex"]
    table = two_tenants["table"]
    first = await a.post("/v1/ask", json={"question": "What does this figure show?", "images": [b64(small_png())],
                                          "max_tokens": 1})
    assert first.status_code == 200, first.text
    conversation = first.json()["conversation_id"]

    image = small_png()
    for _ in range(3):
        r = await b.post("/v1/chat/completions", json=chat_with(image))
        assert r.status_code == 200, r.text
        assert "conversation_id" not in r.json()
    assert table.held_by("globex") == 0 and table.held_by("default") == 1  # a chat makes none
    for _ in range(BOUND + 100):
        r = await b.post("/v1/ask", json={"question": "What does it show?", "images": [b64(image)], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["conversation_id"], r.text
    assert table.held_by("globex") == BOUND

    follow = await a.post("/v1/ask", json={"question": "And its colours?", "conversation_id": conversation,
                                           "max_tokens": 1})
    assert follow.status_code == 200, follow.text
    assert follow.json()["conversation_id"] == conversation and follow.json()["usage"]["vision_encodes"] == 0
