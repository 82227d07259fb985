"""The answer cache as `mmrag serve` uses it (issue 40): a repeated question is answered from the answer it got
before, streamed as it was, with no engine request; anything that changes the answer is a miss; a sampled answer
is never looked up. On the session's API server, whose pipeline gets a cache (disk, or a real Redis) for the
test: the session's settings turn it off so that every other test reaches the engine."""

from __future__ import annotations

import httpx
import pytest

from mmrag import wiring
from serving.metrics import parse_samples, sample_total
from tests.conftest import API_KEY
from tests.test_ask_stream import ask_streamed

AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = "What was the Q3 revenue of the Nordic division and what is the retry limit?"


@pytest.fixture(params=["disk", "redis"])
def cached(request, api_server, tmp_path, monkeypatch):
    """The API server's pipeline with an answer cache of its own (counted in the server's metrics), and a spy on
    its engine that counts the requests the answers send."""
    services = api_server["app"].state.services
    redis_url = request.getfixturevalue("redis_url") if request.param == "redis" else ""
    if redis_url:  # the session's Redis (other tests' keys too): each test starts with no answers kept
        import redis

        from mmrag.adapters.answer_store import REDIS_PREFIX

        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{REDIS_PREFIX}*"):
            client.delete(key)
    settings = api_server["settings"].replace(**{"answer_cache": True, "data_dir": tmp_path,
                                                         "redis_url": redis_url})
    cache = wiring.answer_cache(settings, services.metrics)
    monkeypatch.setattr(services.pipeline, "answers", cache)
    monkeypatch.setattr(services.pipeline, "prompt_version", wiring.answer_prompt_version(settings))
    sent = []
    generate = services.engine.generate

    async def spy(plan, **kw):
        sent.append(plan)
        return await generate(plan, **kw)

    monkeypatch.setattr(services.engine, "generate", spy)
    return {"cache": cache, "sent": sent, "services": services, "backend": request.param}


async def lookups(client: httpx.AsyncClient) -> dict[str, float]:
    samples = parse_samples((await client.get("/metrics")).text)
    return {outcome: sample_total(samples, "mmrag_answer_cache_total", outcome=outcome) for outcome in ("hit", "miss")}


async def test_a_repeated_question_is_streamed_from_the_cache_with_no_engine_request(api_server, cached):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=300) as client:
        before = await lookups(client)
        cold = await ask_streamed(client, {"question": QUESTION})
        asked = len(cached["sent"])
        warm = await ask_streamed(client, {"question": "  what was the Q3 revenue of the Nordic division and what "
                                                       "is the retry limit  "})  # the same question, normalised
        plain = (await client.post("/v1/ask", headers=AUTH, json={"question": QUESTION})).json()
        after = await lookups(client)
    cold_done, warm_done = cold[-1][1]["answer"], warm[-1][1]["answer"]
    assert asked >= 1 and len(cached["sent"]) == asked  # the repeats sent nothing to the engine
    assert (cold_done["usage"]["answer_cache"], warm_done["usage"]["answer_cache"], plain["usage"]["answer_cache"]
            ) == ("miss", "hit", "hit")
    # Streamed as it was: the same events, the same text pieces in the same order, the same answer.
    assert [n for n, _ in warm] == [n for n, _ in cold]
    assert [d["text"] for n, d in warm if n == "token"] == [d["text"] for n, d in cold if n == "token"]
    for field in ("answer", "answer_mode", "answer_mode_reason", "sub_questions", "image_answers"):
        assert warm_done.get(field) == cold_done.get(field) == plain.get(field), field
    # The same pages cited (their ids are in the key); their scores are each request's own retrieval's.
    assert [c["page_id"] for c in warm_done["citations"]] == [c["page_id"] for c in cold_done["citations"]]
    assert plain["citations"] == cold_done["citations"]
    # A hit costs no engine tokens, and says so.
    assert warm_done["usage"]["completion_tokens"] == warm_done["usage"]["prompt_tokens"] == 0
    assert cold_done["usage"]["completion_tokens"] > 0
    assert after["hit"] - before["hit"] == 2 and after["miss"] - before["miss"] == 1


@pytest.mark.parametrize("change", [{"max_tokens": 3}, {"answer_mode": "joint"}, {"docs": ["operations_manual.pdf", "q3_quarterly_report.pdf"]},
                                    {"question": "What is the retry limit of the ingest service?"}],
                         ids=["length", "strategy", "documents", "question"])
async def test_anything_that_changes_the_answer_is_a_miss(api_server, cached, change):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=300) as client:
        first = (await client.post("/v1/ask", headers=AUTH, json={"question": QUESTION, "answer_mode": "split"}))
        other = (await client.post("/v1/ask", headers=AUTH,
                                   json={"question": QUESTION, "answer_mode": "split", **change}))
    assert first.status_code == other.status_code == 200, other.text
    assert other.json()["usage"]["answer_cache"] == "miss" and other.json()["usage"]["completion_tokens"] > 0


async def test_a_changed_prompt_or_model_is_a_miss_and_a_sampled_answer_is_never_looked_up(api_server, cached):
    pipe = cached["services"].pipeline
    cold = await pipe.ask(QUESTION)
    assert cold.answer_cache == "miss" and (await pipe.ask(QUESTION)).answer_cache == "hit"
    version, model = pipe.prompt_version, pipe.engine.model_name
    try:
        pipe.prompt_version = version + "-edited"  # a system prompt or a template changed
        assert (await pipe.ask(QUESTION)).answer_cache == "miss"
        pipe.engine.model_name = "another-model"
        assert (await pipe.ask(QUESTION)).answer_cache == "miss"
    finally:
        pipe.prompt_version, pipe.engine.model_name = version, model
    assert (await pipe.ask(QUESTION)).answer_cache == "hit"
    sent = len(cached["sent"])
    sampled = await pipe.ask(QUESTION, temperature=0.7)
    assert sampled.answer_cache == "off" and len(cached["sent"]) > sent  # it went to the engine, sampled
    assert all(plan.sampling.temperature == 0.7 for plan in cached["sent"][sent:])


async def test_the_openai_route_is_answered_from_the_cache_as_one_message(api_server, cached):
    body = {"model": "mmrag", "messages": [{"role": "user", "content": QUESTION}]}
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=300) as client:
        first = (await client.post("/v1/chat/completions", headers=AUTH, json=body)).json()
        asked = len(cached["sent"])
        again = (await client.post("/v1/chat/completions", headers=AUTH, json=body)).json()
    assert len(cached["sent"]) == asked
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
