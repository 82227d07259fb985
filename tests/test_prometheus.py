"""A real Prometheus scrapes the running app (tiny model) while questions flow; every dashboard expression
must return data through Prometheus' HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from urllib.parse import urlparse

import httpx
import pytest

from serving.dashboards import dashboard_expressions
from tests.conftest import API_KEY, free_port
from tests.waiting import eventually, eventually_sync

CONFIG = """
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: mmrag
    metrics_path: /metrics
    static_configs:
      - targets: ["{target}"]
"""


@pytest.fixture
def prometheus(api_server, tmp_path):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus is not installed: apt-get install prometheus (make test does it as root)")
    (tmp_path / "prometheus.yml").write_text(CONFIG.format(target=urlparse(api_server["url"]).netloc))
    port = free_port()
    proc = subprocess.Popen(
        [exe, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode} before it was ready")
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200

    try:
        eventually_sync(ready, timeout=30, what="prometheus ready", ignoring=(httpx.TransportError,))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def query(prom: str, expr: str) -> list:
    async with httpx.AsyncClient(timeout=10) as client:
        body = (await client.get(f"{prom}/api/v1/query", params={"query": expr})).json()
    assert body["status"] == "success", (expr, body)
    return [r for r in body["data"]["result"] if r["value"][1] not in ("NaN", "+Inf", "-Inf")]


async def test_every_dashboard_expression_has_data_while_traffic_flows(api_server, prometheus, tmp_path,
                                                                       monkeypatch):
    from mmrag import wiring

    # The answer cache's panel: the session's settings turn the cache off; here the questions recur, so it has
    # hits and misses to show (tests/test_answer_cache_serving.py tests the cache itself).
    services = api_server["app"].state.services
    settings = api_server["settings"].replace(**{"answer_cache": True, "data_dir": tmp_path})
    monkeypatch.setattr(services.pipeline, "answers", wiring.answer_cache(settings, services.metrics))
    monkeypatch.setattr(services.pipeline, "prompt_version", wiring.answer_prompt_version(settings))
    questions = ["What is the retry limit and the timeout of the ingest service?",
                 "What was the Q3 revenue of the Nordic division?",
                 "Which components appear in the system architecture?"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    # The session's server runs vLLM in process: no replicas to route between, so no KV events panel
    # (tests/test_dashboard_series.py checks its series on a server over a replica that publishes events).
    missing: list[str] = dashboard_expressions(kv_events=False)
    waves = 0

    async def scraped_after(t: float) -> bool:
        """Prometheus has scraped the app since ``t`` (Unix seconds; Prometheus stamps a scrape with its start)."""
        up = await query(prometheus, 'timestamp(up{job="mmrag"})')
        return bool(up) and float(up[0]["value"][1]) > t

    async def every_expression_has_data() -> bool:
        # Traffic in waves, each one scraped before the next: rates need two scrapes with a change between them.
        # Two new questions a wave (the engine works) and one asked before (an answer-cache hit).
        nonlocal missing, waves
        asked = [f"{questions[(waves + k) % 3]} (wave {waves})" for k in range(2)] + [questions[waves % 3]]
        await asyncio.gather(*(client.post("/v1/ask", json={"question": q}, headers=headers) for q in asked))
        waves += 1
        sent = time.time()
        await eventually(lambda: scraped_after(sent), timeout=30, what=f"a scrape after wave {waves}")
        missing = [e for e in missing if not await query(prometheus, e)]
        return not missing

    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        with contextlib.suppress(AssertionError):  # the assertion below names what is missing
            await eventually(every_expression_has_data, timeout=90, what="data for every dashboard expression")
    assert missing == [], f"dashboard expressions without data after {waves} waves: {missing}"
