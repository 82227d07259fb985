"""Streaming on POST /v1/ask (`"stream": true`): server-sent events on the real app and the session engine.

The events come in order and add up to the answer the JSON route gives (greedy decoding: the same text and
citations); request errors are still the JSON error, before any event; a client that leaves mid-answer stops
its engine work, measured through vLLM's own state and counters as in tests/test_cancel.py.
"""

from __future__ import annotations

import json

import httpx
import pytest

from serving.engine.remote import Told
from tests.conftest import API_KEY
from tests.test_cancel import MAX_TOKENS as LONG  # answer tokens where a client leaves: finishing would show
from tests.test_cancel import WAIT_S, generated_tokens, long_answers  # noqa: F401 - long_answers is a fixture
from tests.test_remote_engine import keys, plan, remote  # noqa: F401 - keys is a fixture
from tests.waiting import eventually

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TWO_PART = "What was the Q3 revenue of the Nordic division and what is the retry limit?"
ONE_PART = "What is the retry limit of the ingest service?"


async def decodes_alone(url: str) -> float:
    """Tokens vLLM generates while answering one more short question beyond that answer's own: 0 when no
    other request decodes meanwhile. A check of its token counter against a known request, not of a wait."""
    before = generated_tokens()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        r = await client.post("/v1/ask", headers=AUTH, json={"question": ONE_PART, "max_tokens": 2,
                                                             "answer_mode": "joint"})
    assert r.status_code == 200, r.text
    own = r.json()["usage"]["completion_tokens"]
    # vLLM counts an engine step's tokens as it hands them out; a hang guard, not a timing assertion.
    await eventually(lambda: generated_tokens() - before >= own, timeout=WAIT_S, what="the probe's tokens counted")
    return generated_tokens() - before - own


async def read_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, in arrival order."""
    events, name = [], None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert data["event"] == name
            events.append((name, data))
    return events


async def ask_streamed(client: httpx.AsyncClient, body: dict) -> list[tuple[str, dict]]:
    async with client.stream("POST", "/v1/ask", headers=AUTH, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        return await read_events(r)


# --- the engines' text callback ---------------------------------------------------------------------------


async def streamed(engine, p) -> tuple[list[str], str]:
    pieces: list[str] = []
    completion = await engine.generate(p, on_text=pieces.append)
    return pieces, completion.text


async def test_both_engines_stream_the_text_they_complete_with(engine_settings, vllm_server, inprocess_engine,
                                                               keys):
    p = plan(keys[0])
    served_engine = remote(engine_settings, [vllm_server])
    try:
        served = await streamed(served_engine, p)
    finally:
        await served_engine.close()
    local = await streamed(inprocess_engine, p)
    # Told in pieces, in order, nothing lost or repeated: the text completed. How many pieces is vLLM's timing, not
    # a contract: its output collector merges the deltas a slow reader has not taken yet into one (a busy host
    # read a whole 12-token answer as one piece with both test workers busy), so the count is not asserted.
    for pieces, text in (local, served):
        assert pieces and all(pieces) and "".join(pieces) == text
    assert served[1] == local[1]  # greedy: the same answer over HTTP


def test_a_resent_request_tells_only_the_text_beyond_what_the_failed_attempt_told():
    told: list[str] = []
    text = Told(told.append)
    first = text.attempt()
    first("Hel")
    first("lo")  # ...then the replica dies; the next one streams the same greedy answer from the start
    second = text.attempt()
    for piece in ("He", "ll", "o, w", "orld"):
        second(piece)
    assert told == ["Hel", "lo", ", w", "orld"] and "".join(told) == "Hello, world"
    assert Told(None).attempt() is None


# --- POST /v1/ask with "stream": true ----------------------------------------------------------------------


@pytest.mark.parametrize("question, mode", [(TWO_PART, "joint"), (TWO_PART, "split"), (ONE_PART, "auto")],
                         ids=["joint", "split", "auto-one-part"])
async def test_the_events_arrive_in_order_and_add_up_to_the_json_answer(api_server, question, mode):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=300) as client:
        events = await ask_streamed(client, {"question": question, "answer_mode": mode})
        r = await client.post("/v1/ask", headers=AUTH, json={"question": question, "answer_mode": mode})
    assert r.status_code == 200, r.text
    plain = r.json()
    names = [n for n, _ in events]
    assert names[:2] == ["sub_questions", "citations"] and names[-1] == "done", names
    assert names.count("done") == 1 and "error" not in names
    done = events[-1][1]["answer"]
    assert events[1][1]["answer_mode"] == done["answer_mode"] == (mode if mode != "auto" else done["answer_mode"])
    assert done["answer_mode"] in ("joint", "split") and done["answer_mode_reason"]
    # The first token comes before the answer is complete (the answer streams; no time is asserted).
    assert "token" in names and names.index("token") < names.index("done")
    assert "".join(d["text"] for n, d in events if n == "token") == done["answer"]
    sub_answers = [{k: v for k, v in d.items() if k != "event"} for n, d in events if n == "sub_answer"]
    assert sorted(map(json.dumps, sub_answers)) == sorted(map(json.dumps, done.get("sub_answers", [])))
    # Joint and split alike: the answer's tokens, no sub-answer before them (those are joint's overflow's).
    assert not sub_answers and "sub_answers" not in done and "answer_s" in done["timings"]
    if done["answer_mode"] == "split" or "image_answers" in done:  # its parts in order (a split's, or a joint
        parts = done["image_answers"]  # answer's over more than one page), each under its page's heading
        assert len(parts) > 1 and events[names.index("token")][1]["text"] == f"{parts[0]['page']}: "
        assert done["answer"] == "".join(f"{'' if i == 0 else chr(10) * 2}{a['page']}: {a['answer']}"
                                         for i, a in enumerate(parts))
    assert events[0][1]["sub_questions"] == done["sub_questions"]
    assert events[1][1]["citations"] == done["citations"]
    # The same answer as without streaming: greedy decoding, fp32.
    for field in ("answer", "sub_questions", "sub_question_source", "citations", "answer_mode", "model"):
        assert done[field] == plain[field], field
    assert done.get("sub_answers") == plain.get("sub_answers")
    assert done.keys() == plain.keys()


@pytest.mark.parametrize("body, status, kind", [
    ({"question": "   "}, 400, "bad_question"),
    ({"question": "What was the revenue?", "docs": ["no_such.pdf"]}, 404, "unknown_document"),
])
async def test_request_errors_are_json_errors_before_the_stream(api_server, body, status, kind):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        r = await client.post("/v1/ask", headers=AUTH, json={**body, "stream": True})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == kind and r.json()["error"]["fix"] is not None


async def test_the_upload_route_streams_too(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=300) as client:
        async with client.stream("POST", "/v1/ask/upload", headers=AUTH,
                                 data={"question": ONE_PART, "stream": "true"}) as r:
            assert r.status_code == 200, await r.aread()
            events = await read_events(r)
    assert events[0][0] == "sub_questions" and events[-1][0] == "done"


async def test_openapi_documents_the_event_stream(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        spec = (await client.get("/openapi.json")).json()
    content = spec["paths"]["/v1/ask"]["post"]["responses"]["200"]["content"]
    assert "application/json" in content and "text/event-stream" in content
    event = content["text/event-stream"]["schema"]["properties"]
    assert "token" in event["event"]["enum"] and event["data"]["contentMediaType"] == "application/json"
    schema = event["data"]["contentSchema"]
    refs = {m["$ref"] for v in schema["properties"].values() for m in [v, *v.get("anyOf", []), v.get("items", {})]
            if isinstance(m, dict) and "$ref" in m}
    assert refs and all(r.removeprefix("#/components/schemas/") in spec["components"]["schemas"] for r in refs), refs
    assert "stream" in spec["components"]["schemas"]["AskRequest"]["properties"]


async def test_a_client_that_leaves_mid_stream_stops_its_engine_work(long_answers, inprocess_engine):
    url, services = long_answers
    scheduler, llm = services.scheduler, inprocess_engine.llm
    cancelled = lambda: services.metrics.registry.get_sample_value("mmrag_answers_total",  # noqa: E731
                                                                   {"outcome": "cancelled", "tenant": "default"}) or 0.0
    cancelled_before, disconnected_before = cancelled(), services.admission.stats.disconnected
    before = generated_tokens()
    seen: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async with client.stream("POST", "/v1/ask", headers=AUTH,
                                 json={"question": ONE_PART, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    seen.append(line.removeprefix("event: "))
                if seen.count("token") >= 3:
                    break  # leave while the answer is being generated: the response is closed here
    assert "done" not in seen
    await eventually(lambda: services.admission.in_flight == 0, timeout=WAIT_S, what="question cancelled")
    await eventually(lambda: llm.output_processor.get_num_unfinished_requests() == 0, timeout=WAIT_S,
                     what="vLLM request aborted")
    assert scheduler.in_flight == 0 and scheduler.waiting == 0
    assert scheduler.stats.cancelled_running >= 1
    assert services.admission.stats.disconnected == disconnected_before + 1
    assert cancelled() == cancelled_before + 1  # counted as a client that left, not as an error
    spent = generated_tokens() - before
    # Finishing the answer would have generated LONG tokens (every plan of it more); it stopped far short.
    assert 0 < spent < LONG / 2, spent
    # Nothing goes on decoding for it: the engine's next request is all that its token counter adds.
    assert await decodes_alone(url) == 0
    print(f"\nstream cancel: left after {seen.count('token')} token events; vLLM generated {spent:.0f} tokens "
          f"of the up to {LONG} (per plan) that finishing would have taken")
