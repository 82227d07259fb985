"""deploy/, docker-compose.yml and the dashboards: valid configs, dashboards in sync with their code, and every
dashboard expression evaluated by a real Prometheus scraping real mmrag metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from serving.dashboards import DASHBOARD_FILE, DATASOURCE_UID, dashboard_expressions
from mmrag.core.engine import Usage
from mmrag.core.keys import ResolutionPolicy
from serving.metrics import Metrics
from serving.scheduler import SchedulerStats
from tests.conftest import free_port
from tests.waiting import eventually_sync

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = REPO / "docker-compose.yml"
COMMITTED_DASHBOARD = DEPLOY / "grafana" / "dashboards" / DASHBOARD_FILE


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def committed_panels() -> list[dict]:
    return json.loads(COMMITTED_DASHBOARD.read_text())["panels"]


# --- Prometheus config ------------------------------------------------------------------------------------


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: apt-get install prometheus (make test does it as root)")
    result = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_api_the_vllm_replica_and_the_vision_service_every_5s_at_their_compose_addresses():
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    assert config["global"]["scrape_interval"] == "5s"
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets == {"mmrag-api": ["api:8080"], "vllm": ["vllm:8000"], "vision": ["vision:8200"]}
    services = load_yaml(COMPOSE)["services"]
    assert "8080:8080" in services["api"]["ports"] and "8000" in services["vllm"]["command"]


def test_compose_prometheus_loads_the_alerting_rules_from_beside_its_config():
    """rule_files is relative to the config file, so promtool here and Prometheus in compose read the same
    deploy/prometheus/alerts.yml (its own tests: tests/test_alerts.py)."""
    assert load_yaml(DEPLOY / "prometheus" / "prometheus.yml")["rule_files"] == ["alerts.yml"]
    mounts = load_yaml(COMPOSE)["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts


# --- dashboards -------------------------------------------------------------------------------------------


def test_the_committed_dashboard_is_a_fresh_render_of_serving_dashboards():
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed: "
                        "pip install -e '.[dashboards]' (make setup does it)")
    from serving.dashboards import build_dashboard, render_json

    assert COMMITTED_DASHBOARD.read_text() == render_json(build_dashboard()), (
        "deploy/grafana/dashboards is stale: run `python -m serving.dashboards --out deploy/grafana/dashboards`"
    )


def test_every_panel_has_prometheus_queries_with_an_expression_and_a_ref_id():
    panels = committed_panels()
    assert len(panels) == 17
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert all(ref_ids) and len(set(ref_ids)) == len(ref_ids), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_dashboard_expressions_are_exactly_the_committed_panels_expressions():
    assert dashboard_expressions() == [t["expr"] for p in committed_panels() for t in p["targets"]]


def test_grafana_provisions_the_datasource_the_dashboards_name_and_the_folder_compose_mounts():
    datasource = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert (datasource["uid"], datasource["type"], datasource["url"]) == (DATASOURCE_UID, "prometheus",
                                                                         "http://prometheus:9090")
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yml")["providers"][0]
    mounts = load_yaml(COMPOSE)["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in mounts
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


# --- docker-compose.yml -----------------------------------------------------------------------------------


def test_docker_compose_parses_the_file():
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client here")
    if subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("the docker client has no compose plugin (`docker compose version` fails)")
    env = {**os.environ, "MMRAG_MODEL": "/models/Qwen2-VL-2B-Instruct"}
    result = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies():
    services = load_yaml(COMPOSE)["services"]
    assert set(services) == {"api", "vllm", "vision", "qdrant", "redis", "prometheus", "grafana"}
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dep, condition in service.get("depends_on", {}).items():
            assert condition == {"condition": "service_healthy"}, f"{name} -> {dep}"
            assert dep in services
    assert set(services["api"]["depends_on"]) == {"vllm", "vision", "qdrant", "redis"}
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])


def test_the_api_talks_to_the_compose_services_and_requires_mmrag_model():
    api = load_yaml(COMPOSE)["services"]["api"]
    env = api["environment"]
    assert env["MMRAG_ENGINE_URLS"] == "http://vllm:8000"
    assert env["MMRAG_QDRANT_URL"] == "http://qdrant:6333"
    assert env["MMRAG_REDIS_URL"] == "redis://redis:6379/0"
    assert env["MMRAG_VISION_URL"] == "http://vision:8200"
    assert env["MMRAG_MODEL"] == "${MMRAG_MODEL:?Variable not set}"
    assert api["command"][:2] == ["mmrag", "serve"]
    assert api["build"] == "."
    assert 'pip install ".[gpu]"' in (REPO / "Dockerfile").read_text()


def test_the_vision_service_gets_its_own_gpu_and_shares_the_apis_store_and_model():
    services = load_yaml(COMPOSE)["services"]
    vision, api = services["vision"], services["api"]
    assert vision["command"][:3] == ["mmrag", "vision", "serve"] and "8200" in vision["command"]
    assert vision["image"] == api["image"]
    env = vision["environment"]
    assert env["MMRAG_REDIS_URL"] == api["environment"]["MMRAG_REDIS_URL"]  # the API reads what it writes
    assert env["MMRAG_MODEL"] == api["environment"]["MMRAG_MODEL"] and env["MMRAG_VISION_DEVICE"] == "cuda"
    devices = vision["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "/readyz" in " ".join(vision["healthcheck"]["test"])


def test_the_image_holds_every_installed_package():
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", (REPO / "Dockerfile").read_text(), flags=re.M))
    assert copied == packages


def test_the_vllm_replica_gets_a_gpu_and_the_serve_flags_of_the_default_engine_config(monkeypatch):
    import torch

    from mmrag.core.settings import Settings
    from mmrag.wiring import engine_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the compose replica runs on a GPU host
    for name in list(os.environ):
        if name.startswith("MMRAG_"):
            monkeypatch.delenv(name)
    vllm = load_yaml(COMPOSE)["services"]["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert vllm["entrypoint"] == ["vllm", "serve"]
    command = vllm["command"]
    assert command[0] == "${MMRAG_MODEL:?Variable not set}"  # the same name the API asks the replica for
    assert command[5:] == engine_config(Settings()).serve_flags()
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert any(v.endswith(":/models:ro") for v in vllm["volumes"])


# --- every dashboard expression against a real Prometheus --------------------------------------------------

PROMETHEUS_CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: mmrag
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


class _GrowingReplica(BaseHTTPRequestHandler):
    """Stand-in for a `vllm serve` replica's /metrics (the real format; see tests/test_metrics.py) whose prefix
    counters grow at every fetch, 400 tokens queried and 300 hit each time: a 75% hit rate."""

    fetches = 0
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802
        with self.lock:
            type(self).fetches += 1
            n = type(self).fetches
        labels = '{engine="0",model_name="m"}'
        body = (
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} 0.4\n"
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{labels} {400 * n}.0\n"
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{labels} {300 * n}.0\n"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Store:
    """The two attributes the metrics read from a FeatureStore (its counting is tested in test_store.py)."""

    backend = "disk"

    def __init__(self) -> None:
        from mmrag.adapters.store import StoreStats

        self.stats = StoreStats()


SCRAPES_OF_TRAFFIC = 5  # Prometheus scrapes every second: rates need two scrapes with traffic between them


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A real Prometheus scraping a live mmrag Metrics registry every second, after it has scraped steady traffic
    SCRAPES_OF_TRAFFIC times."""
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus is not installed: apt-get install prometheus (make test does it as root)")
    replica = ThreadingHTTPServer(("127.0.0.1", 0), _GrowingReplica)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.register_remote_replicas([f"http://127.0.0.1:{replica.server_address[1]}"])
    store = _Store()
    metrics.register_store(store)
    events = KvEvents()
    metrics.register_kv_events(events.index.stats, events.routed)
    api = _serve(_app(metrics))

    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "prometheus.yml").write_text(PROMETHEUS_CONFIG.format(port=api.config.port))
    port = free_port()
    proc = subprocess.Popen(
        [exe, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(workdir / "prometheus.log").open("wb"),
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)

    def running() -> None:
        if proc.poll() is not None:
            log = (workdir / "prometheus.log").read_text()[-2000:]
            pytest.fail(f"prometheus exited with {proc.returncode}: {log}")

    def scrapes() -> int:
        """How many times Prometheus has scraped the app (0 before its first scrape)."""
        running()
        result = query(client, 'count_over_time(up{job="mmrag"}[1h])')
        return int(float(result[0]["value"][1])) if result else 0

    try:
        eventually_sync(lambda: running() or client.get("/-/ready").status_code == 200, timeout=20,
                        what="prometheus ready", ignoring=(httpx.TransportError,))
        # Prometheus applies discovered targets in 5 s batches: wait for its first scrape, then send traffic until
        # it has scraped that traffic SCRAPES_OF_TRAFFIC times.
        first = eventually_sync(scrapes, timeout=20, what="prometheus's first scrape of the app")
        stop = threading.Event()
        feeder = threading.Thread(target=feed, args=(metrics, store, stop, events), daemon=True)
        feeder.start()
        try:
            eventually_sync(lambda: scrapes() >= first + SCRAPES_OF_TRAFFIC, timeout=120,
                            what=f"{SCRAPES_OF_TRAFFIC} scrapes of steady traffic")
        finally:
            stop.set()
            feeder.join()
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=20)
        api.should_exit = True
        api.thread.join(timeout=10)
        replica.shutdown()
        replica.server_close()
        metrics.unregister()


def _app(metrics: Metrics):
    """A throwaway FastAPI app whose /metrics is the one instrument_app adds, as in the real API.

    Served for real, not through prometheus_client's own HTTP server: Prometheus asks for OpenMetrics, and
    prometheus_client 0.26 then writes `vllm:x` samples as `vllm_x` (prometheus/client_python#1177), while
    the instrumentator's /metrics always answers the classic text format, which keeps the colons.
    """
    from fastapi import FastAPI

    app = FastAPI()
    metrics.instrument_app(app)
    return app


def _serve(app):
    """uvicorn in a thread on a free port; stop with ``server.should_exit = True``."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    server.thread = threading.Thread(target=server.run, daemon=True)
    server.thread.start()

    def started() -> bool:
        if not server.thread.is_alive():
            pytest.fail("uvicorn did not start: its thread ended")
        return server.started

    eventually_sync(started, timeout=20, what="uvicorn started")
    return server


class KvEvents:
    """A replica's KV events index (the real one, fed batches here instead of from a socket) and the routes."""

    REPLICA = "http://127.0.0.1:8100"

    def __init__(self) -> None:
        from collections import Counter

        from serving.kv_events import KvEventIndex, State

        self.index, self.routed, self.seq = KvEventIndex(), Counter(), 0
        self.index.add(self.REPLICA)
        self.index._set(self.REPLICA, State.SYNCED)

    def route(self) -> None:
        from serving.kv_events import EventBatch, _Stored

        self.index._apply(self.REPLICA, self.seq, EventBatch(0.0, [_Stored(block_hashes=[self.seq])]))
        self.seq += 1
        self.routed["events"] += 1


def feed(metrics: Metrics, store: _Store, stop: threading.Event, events: KvEvents) -> None:
    """Steady traffic with known proportions, one record every 50 ms until ``stop`` is set: 75% of image tokens
    cached, image share of computed prefill (512-384)/(1000-600) = 32%, 2 of 3 feature-store lookups hit, 3 of 5
    answer-cache lookups hit, TTFT 0.2 s, queue waits of 10 ms, a quarter of the KV capacity held by image
    tokens."""
    stats = SchedulerStats()
    while not stop.is_set():
        metrics.record_completion(Usage(prompt_tokens=1000, image_tokens=512, cached_tokens=600,
                                        cached_image_tokens=384, completion_tokens=8, ttft_s=0.2,
                                        image_input="embeds"))
        metrics.record_answer("ok", 0.8)
        for outcome in ("hit", "hit", "hit", "miss", "miss"):
            metrics.record_answer_cache(outcome)
        stats.submitted += 1
        stats.dispatched += 1
        stats.queue_waits_s.append(0.01)
        stats.group_sizes.append(2)
        stats.image_tokens_by_policy.append((ResolutionPolicy(3136, 200704), 512))
        stats.kv_image_tokens, stats.kv_capacity_tokens = 8192, 32768
        metrics.drain_scheduler(stats)
        for hit in (True, True, False):
            store.stats.record_lookup(hit, nbytes=1024 if hit else 0)
        metrics.set_warm_set(pages=4, tokens=2048)
        events.route()
        stop.wait(0.05)  # the traffic's pace, as a live server records it (and a prompt end once stopped)


def query(prometheus: httpx.Client, expr: str) -> list[dict]:
    resp = prometheus.get("/api/v1/query", params={"query": expr})
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def test_every_dashboard_expression_evaluates_on_a_real_prometheus(prometheus):
    for expr in dashboard_expressions():
        result = query(prometheus, expr)
        assert result, f"{expr} returned no series after {SCRAPES_OF_TRAFFIC} scrapes of traffic"


@pytest.mark.parametrize(("panel", "expected"), [
    ("Image-prefix hit rate", 0.75),
    ("Vision-token cache hit rate", 2 / 3),
    ("Answer cache hit rate", 0.6),
    ("Image prefill share", 0.32),
    ("vLLM prefix-cache hit rate", 0.75),
    ("Image tokens in the KV cache", 0.25),
])
def test_ratio_panels_show_the_proportions_that_were_recorded(prometheus, panel, expected):
    from serving.dashboards import PANELS

    (spec,) = [p for p in PANELS if p.title == panel]
    (series,) = query(prometheus, spec.queries[0].expr)
    # The counters of one record_*() call are bumped one after another, so a scrape can land between them.
    assert float(series["value"][1]) == pytest.approx(expected, abs=0.03)


def test_the_image_input_panel_shows_each_form_apart_and_no_request_time_forwards(prometheus):
    """Only embeds-form requests were recorded (one per 50 ms), none in the pixels form and no vision forward."""
    from serving.dashboards import PANELS

    spec = {p.title: p for p in PANELS}["Image input form and request-time vision forwards"]
    by_form = {s["metric"]["form"]: float(s["value"][1]) for s in query(prometheus, spec.queries[0].expr)}
    assert set(by_form) == {"embeds", "pixels"} and by_form["pixels"] == 0 and by_form["embeds"] > 1
    (forwards,) = query(prometheus, spec.queries[1].expr)
    assert float(forwards["value"][1]) == 0


def test_latency_quantiles_fall_in_the_bucket_of_the_recorded_value(prometheus):
    from serving.dashboards import PANELS

    ttft = {p.title: p for p in PANELS}["Time to first token"]
    for q in ttft.queries:  # 0.2 s lies in the (0.1, 0.25] bucket
        (series,) = query(prometheus, q.expr)
        assert 0.1 < float(series["value"][1]) <= 0.25, q.legend
    wait = {p.title: p for p in PANELS}["Scheduler queue wait"]
    for q in wait.queries:  # 10 ms lies in the (0.005, 0.01] bucket
        (series,) = query(prometheus, q.expr)
        assert 0.005 < float(series["value"][1]) <= 0.01, q.legend
