"""Overload: 1,000 concurrent /v1/ask on the real app and engine. Every one is answered (at once, or after a
wait within MMRAG_ADMISSION_MAX_WAIT_S) or refused with 429 + Retry-After — none a 5xx, none hangs — and what
is admitted stays bounded. tests/test_admission_wait.py tests the wait itself.

Latency and memory figures are printed (pytest -s); they are measured, never asserted.
"""

from __future__ import annotations

import asyncio
import resource
import statistics

import psutil

from tests.burst import burst
from tests.conftest import API_KEY

QUESTIONS = [
    "What is the retry limit and the timeout of the ingest service?",
    "What was the Q3 revenue of the Nordic division?",
    "Which components appear in the system architecture?",
    "How long are backups retained and who is on call?",
    "What hit rate did the page cache reach?",
]
N = 1000



def raise_open_files_limit(needed: int) -> None:
    """1,000 server sockets live in this process; the client process inherits the limit for its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


async def test_1000_concurrent_questions_are_answered_or_refused_with_429_none_5xx(api_server):
    services = api_server["app"].state.services
    scheduler, admission = services.scheduler, services.admission
    limit, max_sub = admission.limit, api_server["settings"].answer.max_sub_questions
    raise_open_files_limit(4 * N + 1024)
    registry = services.metrics.registry
    refused_before = registry.get_sample_value("mmrag_answers_total", {"outcome": "refused", "tenant": "default"})
    process = psutil.Process()
    rss_before = process.memory_info().rss
    peak = {"questions": 0, "plans": 0, "rss": rss_before}
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            peak["questions"] = max(peak["questions"], admission.in_flight)
            peak["plans"] = max(peak["plans"], scheduler.waiting + scheduler.in_flight)
            peak["rss"] = max(peak["rss"], process.memory_info().rss)
            await asyncio.sleep(0.01)

    # The clients run in their own process, as real clients would: their CPU is not the server loop's.
    watcher = asyncio.create_task(watch())
    bodies = [{"question": QUESTIONS[i % len(QUESTIONS)]} for i in range(N)]
    sent, wall = await burst(api_server["url"], API_KEY, bodies)
    done.set()
    await watcher
    results = [(r["status"], r["s"], r) for r in sent]
    statuses = [s for s, _, _ in results]
    counts = {s: statuses.count(s) for s in set(statuses)}
    assert set(counts) <= {200, 429} and counts.get(200, 0) >= limit, counts
    refused = [r for s, _, r in results if s == 429]
    assert refused, "1,000 at once must exceed the bound"
    assert registry.get_sample_value("mmrag_answers_total", {"outcome": "refused", "tenant": "default"}) - refused_before == len(refused)
    for r in refused:
        assert int(r["retry_after"]) >= 1 and r["error"]["type"] == "overloaded" and "Retry-After" in r["error"]["fix"]
    # Bounded: never more questions than the limit, never more plans than they can hold; all drained.
    assert peak["questions"] <= limit and peak["plans"] <= limit * (max_sub + 1)
    assert admission.in_flight == 0 and scheduler.waiting == 0 and scheduler.in_flight == 0

    answered = sorted(t for s, t, _ in results if s == 200)
    refused_s = sorted(t for s, t, _ in results if s == 429)
    print(f"\noverload: {N} concurrent asks in {wall:.1f}s; {len(answered)} answered (limit {limit} in flight), "
          f"{len(refused_s)} refused with 429; answered p50 {statistics.median(answered):.2f}s "
          f"max {answered[-1]:.2f}s; refused p50 {statistics.median(refused_s) * 1000:.0f} ms "
          f"max {refused_s[-1]:.2f}s; peak plans {peak['plans']}; server process RSS {rss_before / 2**20:.0f} MiB "
          f"before, peak {peak['rss'] / 2**20:.0f} MiB (+{(peak['rss'] - rss_before) / 2**20:.0f} MiB)")
