"""The OpenAI-compatible routes on the session's real server, spoken to by the clients people use: the `openai`
SDK and llama-index's `OpenAILike`. The model `mmrag` answers from the corpus with footnoted citations (also in
`citations`), `max_tokens` bounds it, an image resent in a later turn is neither encoded again nor prefilled
again (its KV comes from the prefix cache), and bad input gets the project's error shape with the fix.

The server runs on the test's event loop: the async `openai` client is used, and llama-index's sync calls run
in a thread."""

from __future__ import annotations

import asyncio
import base64
import json
import re

import httpx
import openai
import pytest
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike

from ingestion.loaders import decode_image, image_content_hash
from rag.answer import RANDOM_MODEL_NOTE
from tests.conftest import API_KEY
from tests.test_ask_images import image_prefix_bound, new_figure
from tests.test_ask_stream import decodes_alone
from tests.test_cancel import MAX_TOKENS as LONG  # answer tokens where a client leaves: finishing would show
from tests.test_cancel import WAIT_S, generated_tokens, long_answers  # noqa: F401 - long_answers is a fixture
from tests.waiting import eventually

AUTH = {"Authorization": f"Bearer {API_KEY}"}
RETRY = "What is the retry limit of the ingest service?"
FOOTNOTE = re.compile(r"^\[(\d+)\] (.+), page (\d+)$")


@pytest.fixture
def client(api_server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api_server["url"] + "/v1", api_key=API_KEY, timeout=300, max_retries=0)


@pytest.fixture
async def http(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=300, headers=AUTH) as c:
        yield c


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def cited_footnotes(content: str) -> list[tuple[str, int]]:
    """The footnotes that end an answer's text, as (doc, page)."""
    lines = content.rsplit("\n\n", 1)[-1].splitlines()
    matches = [FOOTNOTE.match(line) for line in lines]
    assert all(matches), content
    assert [int(m[1]) for m in matches] == list(range(1, len(matches) + 1)), content
    return [(m[2], int(m[3])) for m in matches]


async def test_models_lists_mmrag_in_the_openai_shape(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["mmrag"] and models.data[0].object == "model"
    assert models.data[0].model_extra["random_weights"] is True  # the session's tiny random-weight model


async def test_the_openai_client_gets_an_answer_with_footnoted_citations_and_usage(client):
    done = await client.chat.completions.create(
        model="mmrag", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": RETRY}])
    (choice,) = done.choices
    assert done.object == "chat.completion" and choice.message.role == "assistant" and choice.finish_reason == "stop"
    citations = done.model_extra["citations"]
    assert citations and cited_footnotes(choice.message.content) == [(c["doc"], c["page"]) for c in citations]
    # A chat client shows the text alone: a random-weight model says so in it, before the footnotes.
    assert f"\n\n({RANDOM_MODEL_NOTE})\n\n[1] " in choice.message.content
    usage = done.usage
    assert usage.prompt_tokens > usage.model_extra["image_tokens"] > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


async def test_a_footnote_names_the_figure_a_question_about_it_was_answered_from(client):
    """Issue 26: the sample paper's page 4 holds "Figure 4: hit rate by workload"; the footnote of its citation
    names the figure after the page, as the citation's `figure` does."""
    done = await client.chat.completions.create(
        model="mmrag", messages=[{"role": "user", "content": "What does Figure 4 show about the hit rate?"}])
    citations = done.model_extra["citations"]
    (cited,) = [c for c in citations if c["figure"] is not None]
    assert (cited["doc"], cited["page"], cited["figure"]["number"]) == ("page_cache_paper.pdf", 4, 4)
    notes = done.choices[0].message.content.rsplit("\n\n", 1)[-1].splitlines()
    assert f"[{citations.index(cited) + 1}] page_cache_paper.pdf, page 4, Figure 4: hit rate by workload" in notes
    assert len(notes) == len(citations)


async def test_the_openai_client_streams_the_answer_then_its_footnotes_then_the_usage(client):
    stream = await client.chat.completions.create(model="mmrag", messages=[{"role": "user", "content": RETRY}],
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens > 0 and last.usage.prompt_tokens_details is not None
    deltas = [c.choices[0].delta.content or "" for c in content]
    assert content[0].choices[0].delta.role == "assistant" and len([d for d in deltas if d]) >= 3  # tokens, notes
    assert [c.choices[0].finish_reason for c in content][-1] == "stop"
    citations = content[-1].model_extra["citations"]
    assert citations and cited_footnotes("".join(deltas)) == [(c["doc"], c["page"]) for c in citations]
    assert f"\n\n({RANDOM_MODEL_NOTE})\n\n[1] " in "".join(deltas)
    print(f"\nchat stream: {len(chunks)} chunks ({len([d for d in deltas if d])} with content), usage "
          f"{last.usage.prompt_tokens} prompt / {last.usage.prompt_tokens_details.cached_tokens} cached / "
          f"{last.usage.completion_tokens} completion tokens")


async def test_a_client_that_closes_the_stream_stops_its_engine_work(long_answers, inprocess_engine):
    url, services = long_answers
    llm = inprocess_engine.llm
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=300, max_retries=0)
    disconnected_before, before = services.admission.stats.disconnected, generated_tokens()
    stream = await client.chat.completions.create(model="mmrag", messages=[{"role": "user", "content": RETRY}],
                                                  stream=True)
    pieces = 0
    async for chunk in stream:
        pieces += bool(chunk.choices and chunk.choices[0].delta.content)
        if pieces >= 3:
            break
    await stream.close()  # leave while the answer is being generated
    await eventually(lambda: services.admission.in_flight == 0, timeout=WAIT_S, what="question cancelled")
    await eventually(lambda: llm.output_processor.get_num_unfinished_requests() == 0, timeout=WAIT_S,
                     what="vLLM request aborted")
    assert services.admission.stats.disconnected == disconnected_before + 1
    spent = generated_tokens() - before
    assert 0 < spent < LONG / 2, spent  # finishing would have generated LONG tokens per plan
    # Nothing goes on decoding for it: the engine's next request is all that its token counter adds.
    assert await decodes_alone(url) == 0
    print(f"\nchat stream closed after 3 content chunks: vLLM generated {spent:.0f} of up to {LONG} tokens per plan")


@pytest.mark.parametrize("bound", ["max_tokens", "max_completion_tokens"])  # one bound, OpenAI's two names
async def test_max_tokens_bounds_every_completion_of_the_answer(client, http, bound):
    for mode in ("joint", "split"):  # the mode from the request, as the openai client sends it
        full = (await http.post("/v1/ask", json={"question": RETRY, "answer_mode": mode})).json()
        assert full["answer_mode"] == mode or len(full["citations"]) == 1, full  # split over one page is joint
        short = await client.chat.completions.create(model="mmrag", temperature=0.7, **{bound: 1},
                                                     messages=[{"role": "user", "content": RETRY}],
                                                     extra_body={"answer_mode": mode})
        # A split answer's parts share its length: one token in all, however many pages it found.
        assert short.usage.completion_tokens <= 1 < full["usage"]["completion_tokens"], mode


async def test_max_tokens_and_max_completion_tokens_that_differ_are_a_400(client):
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="mmrag", max_tokens=1, max_completion_tokens=4,
                                             messages=[{"role": "user", "content": RETRY}])
    assert refused.value.type == "conflicting_parameters" and "max_completion_tokens" in refused.value.message
    same = await client.chat.completions.create(model="mmrag", max_tokens=1, max_completion_tokens=1,
                                                messages=[{"role": "user", "content": RETRY}],
                                                extra_body={"answer_mode": "joint"})
    assert same.usage.completion_tokens == 1


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 3}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"tools": [WEATHER_TOOL]}, "tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}, "response_format"),
])
async def test_a_field_that_cannot_be_honoured_is_refused_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="mmrag", messages=[{"role": "user", "content": RETRY}], **fields)
    error = refused.value
    assert error.type == "unsupported_parameter" and error.param == param and f"`{param}`" in error.message
    assert error.body["fix"] and param in error.body["fix"], error.body


@pytest.mark.parametrize("fields", [
    {"n": 1}, {"logprobs": False}, {"top_logprobs": 0}, {"tools": []}, {"tool_choice": "none"},
    {"tools": [WEATHER_TOOL], "tool_choice": "none"}, {"tool_choice": "auto"}, {"response_format": {"type": "text"}},
], ids=lambda f: json.dumps(f)[:40])
async def test_the_same_fields_at_what_is_served_are_accepted(http, fields):
    r = await http.post("/v1/chat/completions", json={"model": "mmrag", "max_tokens": 1, "answer_mode": "joint",
                                                       "messages": [{"role": "user", "content": RETRY}], **fields})
    assert r.status_code == 200, r.text


async def test_an_image_resent_in_a_later_turn_is_not_encoded_again_and_its_kv_is_reused(client, api_server):
    services = api_server["app"].state.services
    await services.engine.reset_prefix_cache()
    png = new_figure()
    first_turn = {"role": "user", "content": [{"type": "text", "text": "What does this figure show?"},
                                               {"type": "image_url", "image_url": {"url": data_url(png)}}]}
    one = await client.chat.completions.create(model="mmrag", messages=[first_turn])
    assert one.usage.model_extra["vision_encodes"] == 1

    history = [first_turn, {"role": "assistant", "content": one.choices[0].message.content},
               {"role": "user", "content": "What is the input of its third module?"}]
    two = await client.chat.completions.create(model="mmrag", messages=history)
    encoder = services.question_images._encoder
    key = encoder.key_for(image_content_hash(decode_image(png, services.settings.documents)))
    bound = image_prefix_bound(services, key, encoder.num_tokens_for(decode_image(png, services.settings.documents)))
    assert bound >= 64
    assert two.usage.model_extra["vision_encodes"] == 0
    assert two.usage.prompt_tokens_details.cached_tokens >= two.usage.model_extra["cached_image_tokens"] >= bound
    print(f"\nchat image resent in turn 2: 0 vision forwards, {two.usage.prompt_tokens_details.cached_tokens}/"
          f"{two.usage.prompt_tokens} prompt tokens cached ({two.usage.model_extra['cached_image_tokens']} image "
          f"tokens; bound {bound})")


async def test_llama_index_openai_like_chats(api_server):
    llm = OpenAILike(model="mmrag", api_base=api_server["url"] + "/v1", api_key=API_KEY, is_chat_model=True,
                     max_tokens=4, timeout=300, max_retries=0)
    reply = await asyncio.to_thread(llm.chat, [ChatMessage(role="user", content=RETRY)])
    assert reply.message.role == "assistant" and cited_footnotes(reply.message.content)
    assert reply.raw.model_extra["citations"]
    pieces = await asyncio.to_thread(lambda: [r.delta for r in llm.stream_chat([ChatMessage(role="user",
                                                                                            content=RETRY)])])
    assert len(pieces) >= 2 and cited_footnotes("".join(pieces))


@pytest.mark.parametrize("body, status, kind, names", [
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": RETRY}]}, 422, "invalid_request", "mmrag"),
    ({"model": "mmrag", "messages": [{"role": "system", "content": "hi"}]}, 400, "no_question", "user"),
    ({"model": "mmrag", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, 400, "invalid_image",
     "data:image/png;base64"),
    ({"model": "mmrag", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]},
     400, "invalid_image", "base64"),
    ({"model": "mmrag", "messages": [{"role": "user", "content": ""}]}, 400, "bad_question", ""),
    # streamed too: what fails before the answer begins is the JSON error with its status, not an event
    ({"model": "mmrag", "stream": True, "messages": [{"role": "user", "content": ""}]}, 400, "bad_question", ""),
])
async def test_bad_input_gets_the_error_shape_with_the_fix(http, body, status, kind, names):
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"type", "message", "fix"} and err["type"] == kind and names in err["message"] + err["fix"]


async def test_a_wrong_key_is_refused_as_on_v1_ask(api_server):
    wrong = openai.AsyncOpenAI(base_url=api_server["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="MMRAG_API_KEY"):
        await wrong.chat.completions.create(model="mmrag", messages=[{"role": "user", "content": RETRY}])
