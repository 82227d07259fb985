"""Load: 200 concurrent /v1/ask requests on the real app and engine — none lost, no 5xx, the queue bounded.

Latency figures are printed (pytest -s) for the closing note; they are measured, never asserted.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from tests.conftest import API_KEY

QUESTIONS = [
    "What is the retry limit and the timeout of the ingest service?",
    "What was the Q3 revenue of the Nordic division?",
    "Which components appear in the system architecture?",
    "How long are backups retained and who is on call?",
    "What hit rate did the page cache reach?",
]
N = 200


async def test_200_concurrent_questions_complete_with_none_lost_and_no_5xx(api_server):
    scheduler = api_server["app"].state.services.scheduler
    max_sub = api_server["settings"].max_sub_questions
    peak = 0
    done = asyncio.Event()

    async def watch_queue() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, scheduler.waiting)
            await asyncio.sleep(0.01)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float]:
        started = time.perf_counter()
        r = await client.post("/v1/ask", json={"question": QUESTIONS[i % len(QUESTIONS)]},
                              headers={"Authorization": f"Bearer {API_KEY}"})
        return r.status_code, time.perf_counter() - started

    limits = httpx.Limits(max_connections=N, max_keepalive_connections=N)
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=600, limits=limits) as client:
        watcher = asyncio.create_task(watch_queue())
        started = time.perf_counter()
        results = await asyncio.gather(*(one(client, i) for i in range(N)))
        wall = time.perf_counter() - started
        done.set()
        await watcher
    statuses = [s for s, _ in results]
    latencies = sorted(t for _, t in results)
    assert len(results) == N and statuses.count(200) == N, {s: statuses.count(s) for s in set(statuses)}
    # Bounded: at most every request's sub-question plans (plus its synthesis) wait at once, and all drain.
    assert peak <= N * (max_sub + 1) and scheduler.waiting == 0 and scheduler.in_flight == 0
    p99 = latencies[int(0.99 * (N - 1))]
    print(f"\nload: {N} requests in {wall:.1f}s ({N / wall:.1f} q/s); latency p50 {statistics.median(latencies):.2f}s "
          f"p99 {p99:.2f}s; peak queue {peak}; gated {scheduler.stats.gated}; "
          f"fairness overrides {scheduler.stats.fairness_overrides}")
