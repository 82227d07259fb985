"""Cancellation end to end: a client that leaves cancels its question, in the scheduler and in vLLM.

Measured through vLLM's own state and counters (the in-process AsyncLLM's unfinished requests and its
`vllm:generation_tokens_total`), on the real app and the session engine, with answers long enough
(``answer_max_tokens`` 1,000) that finishing the abandoned work would show.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import REGISTRY

from tests.conftest import API_KEY, copy_corpus, serving
from tests.waiting import eventually

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 1000
CLIENTS = 6


def generated_tokens() -> float:
    """vLLM's own counter of generated tokens (all label sets: the model label is its served name)."""
    return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == "vllm:generation_tokens_total")


@pytest.fixture(scope="module")
async def long_answers(engine_settings, ingested, inprocess_engine, tmp_path_factory):
    from mmrag.wiring import create_app

    data = tmp_path_factory.mktemp("cancel-data")
    copy_corpus(engine_settings, data)
    settings = engine_settings.replace(**{
        "data_dir": data, "api_key": API_KEY, "answer_max_tokens": MAX_TOKENS, "warm_top": 0,
    })
    app = create_app(settings, engine=inprocess_engine, store=inprocess_engine.features.store)
    async with serving(app) as url:
        yield url, app.state.services


WAIT_S = 60.0  # each wait's hang guard, not a timing assertion


async def test_clients_that_leave_cancel_their_plans_and_vllm_aborts_them(long_answers, inprocess_engine):
    url, services = long_answers
    scheduler, llm = services.scheduler, inprocess_engine.llm
    before = generated_tokens()
    cancelled_before = services.metrics.registry.get_sample_value("mmrag_answers_total", {"outcome": "cancelled", "tenant": "default"})
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        asks = [asyncio.create_task(client.post("/v1/ask", headers=AUTH,
                                                json={"question": f"What does figure {i} of the report show?"}))
                for i in range(CLIENTS)]
        # Leave once answers are being generated and more wait (decompositions done, plans in the engine).
        await eventually(lambda: scheduler.in_flight == scheduler.stats.max_concurrency and scheduler.waiting > 0
                         and generated_tokens() > before, timeout=WAIT_S,
                         what="plans running, generating, and queued")
        running_at_leave = generated_tokens() - before
        for task in asks:
            task.cancel()
        await asyncio.gather(*asks, return_exceptions=True)
        left = sum(task.cancelled() for task in asks)  # an answer may have arrived before its client left

    await eventually(lambda: services.admission.in_flight == 0, timeout=WAIT_S, what="questions cancelled")
    await eventually(lambda: llm.output_processor.get_num_unfinished_requests() == 0, timeout=WAIT_S,
                     what="vLLM requests aborted")
    # A running plan's slot is freed by its own task once vLLM has aborted it (serving/scheduler._run's finally),
    # after the question's task has ended: waited for as an event, never raced.
    await eventually(lambda: scheduler.waiting == 0 and scheduler.in_flight == 0, timeout=WAIT_S,
                     what="every plan out of the scheduler")
    assert left >= CLIENTS - 2 and services.admission.stats.disconnected == left
    cancelled_after = services.metrics.registry.get_sample_value("mmrag_answers_total", {"outcome": "cancelled", "tenant": "default"})
    assert cancelled_after - cancelled_before == left
    cancelled = scheduler.stats.cancelled_running + scheduler.stats.cancelled_queued
    assert scheduler.stats.cancelled_running >= 1 and scheduler.stats.cancelled_queued >= 1, cancelled
    # Finishing them would have generated up to CLIENTS × plans × MAX_TOKENS tokens; a little more than what was
    # in flight when they left is all vLLM made.
    spent = generated_tokens() - before
    assert 0 < spent < CLIENTS * MAX_TOKENS / 2, spent
    print(f"\ncancel: {left} of {CLIENTS} clients left; {scheduler.stats.cancelled_queued} plans left the queue, "
          f"{scheduler.stats.cancelled_running} were aborted in vLLM; {running_at_leave:.0f} tokens generated when they left, {spent:.0f} in all")

    # The server goes on serving.
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        r = await client.post("/v1/ask", headers=AUTH, json={"question": "What is the retry limit?"})
    assert r.status_code == 200, r.text
