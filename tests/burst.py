"""Bursts of concurrent /v1/ask from a process of their own, each question on its own connection, in plain
HTTP/1.1 over asyncio streams: a client this thin measures the server (an in-process httpx client's own
per-request cost, on the server's loop and 2 cores, is several times the server's refusal cost and would be
what a 1,000-client test measured). Used by tests/test_load.py and tests/test_admission_wait.py.

Run as a script: ``python tests/burst.py URL KEY < BODIES_JSON`` sends each body of the JSON list at once and
prints ``{"wall_s", "results": [{status, s, retry_after, error}]}``. The timeout is the hang guard: a request
unanswered within it fails the run.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

HANG_GUARD_S = 300


async def _ask(host: str, port: int, key: str, body: bytes) -> dict:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/ask HTTP/1.1\r\nHost: mmrag\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = dict(h.lower().split(": ", 1) for h in head[1:] if h)
    payload = json.loads(await reader.readexactly(int(headers["content-length"])))
    writer.close()
    return {"status": int(head[0].split()[1]), "s": time.perf_counter() - started,
            "retry_after": headers.get("retry-after"), "error": payload.get("error")}


async def _main(url: str, key: str, bodies: list[dict]) -> None:
    host, port = url.removeprefix("http://").split(":")
    started = time.perf_counter()
    results = await asyncio.wait_for(
        asyncio.gather(*(_ask(host, int(port), key, json.dumps(b).encode()) for b in bodies)), HANG_GUARD_S)
    print(json.dumps({"wall_s": time.perf_counter() - started, "results": results}))


async def burst(url: str, key: str, bodies: list[dict]) -> tuple[list[dict], float]:
    """Each of ``bodies`` asked at once from another process: the results, in order, and the clients' wall time."""
    client = await asyncio.create_subprocess_exec(sys.executable, str(Path(__file__)), url, key,
                                                  stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    out, _ = await client.communicate(json.dumps(bodies).encode())
    assert client.returncode == 0, "the burst's clients failed (a request unanswered within the hang guard?)"
    run = json.loads(out)
    return run["results"], run["wall_s"]


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())))
