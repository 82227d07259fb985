"""Overload: 1,000 concurrent /v1/ask on the real app and engine. Every one is answered or refused at once
with 429 + Retry-After — none a 5xx, none hangs — and what is admitted stays bounded.

Latency and memory figures are printed (pytest -s) for the README; they are measured, never asserted.
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
import sys

import psutil

from tests.conftest import API_KEY

QUESTIONS = [
    "What is the retry limit and the timeout of the ingest service?",
    "What was the Q3 revenue of the Nordic division?",
    "Which components appear in the system architecture?",
    "How long are backups retained and who is on call?",
    "What hit rate did the page cache reach?",
]
N = 1000

# N concurrent asks from one process, each on its own connection, in plain HTTP/1.1 over asyncio streams: a
# client this thin measures the server (httpx's own per-request cost, in one process, is several times the
# server's refusal cost and would be what a 1,000-client test measured). Prints {"wall_s", "results":
# [{status, s, retry_after, error}]}. The timeout is the hang guard: a request unanswered within it fails.
CLIENTS = """
import asyncio, json, sys, time

url, n, key = sys.argv[1], int(sys.argv[2]), sys.argv[3]
host, port = url.removeprefix("http://").split(":")
questions = %r

async def one(i):
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"question": questions[i %% len(questions)]}).encode()
    writer.write(b"POST /v1/ask HTTP/1.1\\r\\nHost: mmrag\\r\\nContent-Type: application/json\\r\\n"
                 b"Authorization: Bearer " + key.encode() + b"\\r\\nContent-Length: %%d\\r\\n\\r\\n" %% len(body) + body)
    await writer.drain()
    head = (await reader.readuntil(b"\\r\\n\\r\\n")).decode("latin-1").split("\\r\\n")
    headers = dict(h.lower().split(": ", 1) for h in head[1:] if h)
    payload = json.loads(await reader.readexactly(int(headers["content-length"])))
    writer.close()
    return {"status": int(head[0].split()[1]), "s": time.perf_counter() - started,
            "retry_after": headers.get("retry-after"), "error": payload.get("error")}

async def main():
    started = time.perf_counter()
    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), timeout=300)
    print(json.dumps({"wall_s": time.perf_counter() - started, "results": results}))

asyncio.run(main())
""" % (QUESTIONS,)


def raise_open_files_limit(needed: int) -> None:
    """1,000 server sockets live in this process; the client process inherits the limit for its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


async def test_1000_concurrent_questions_are_answered_or_refused_with_429_none_5xx(api_server):
    services = api_server["app"].state.services
    scheduler, admission = services.scheduler, services.admission
    limit, max_sub = admission.limit, api_server["settings"].max_sub_questions
    raise_open_files_limit(4 * N + 1024)
    registry = services.metrics.registry
    refused_before = registry.get_sample_value("mmrag_answers_total", {"outcome": "refused"})
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
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENTS, api_server["url"], str(N), API_KEY, stdout=asyncio.subprocess.PIPE)
    watcher = asyncio.create_task(watch())
    out, _ = await client.communicate()
    done.set()
    await watcher
    assert client.returncode == 0
    run = json.loads(out)
    wall, results = run["wall_s"], [(r["status"], r["s"], r) for r in run["results"]]
    statuses = [s for s, _, _ in results]
    counts = {s: statuses.count(s) for s in set(statuses)}
    assert set(counts) <= {200, 429} and counts.get(200, 0) >= limit, counts
    refused = [r for s, _, r in results if s == 429]
    assert refused, "1,000 at once must exceed the bound"
    assert registry.get_sample_value("mmrag_answers_total", {"outcome": "refused"}) - refused_before == len(refused)
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
