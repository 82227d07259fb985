"""serving/metrics: what a scrape of the registry shows after the app recorded its stats.

Every test builds ``Metrics`` on a fresh CollectorRegistry (the app passes the global one) and reads the
samples back the way Prometheus would see them.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy, Tiers
from mmrag.core.pages import EncodedImage
from mmrag.adapters.store import DiskFeatureStore, RedisFeatureStore
from mmrag.core.engine import Usage
from serving.metrics import Metrics, Samples, parse_samples
from serving.scheduler import SchedulerStats
from tests.conftest import free_port


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry) -> Iterator[Metrics]:
    m = Metrics(registry)
    yield m
    m.unregister()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def scrape(registry: CollectorRegistry) -> Samples:
    """The exposition text, parsed back: sample name -> [(labels, value)]."""
    return parse_samples(generate_latest(registry).decode())


# --- engine requests and answers --------------------------------------------------------------------------


def test_a_completion_adds_its_tokens_to_the_token_counters(registry, metrics):
    metrics.record_completion(Usage(prompt_tokens=600, image_tokens=512, cached_tokens=400, cached_image_tokens=384,
                                    vision_encodes=1, completion_tokens=20, ttft_s=0.3))
    metrics.record_completion(Usage(prompt_tokens=330, image_tokens=256, cached_tokens=0, cached_image_tokens=0,
                                    vision_encodes=0, completion_tokens=7, ttft_s=1.5))

    assert value(registry, "mmrag_engine_requests_total") == 2
    assert value(registry, "mmrag_prompt_tokens_total") == 930
    assert value(registry, "mmrag_prompt_tokens_cached_total") == 400
    assert value(registry, "mmrag_image_tokens_total") == 768
    assert value(registry, "mmrag_image_tokens_cached_total") == 384
    assert value(registry, "mmrag_completion_tokens_total") == 27
    assert value(registry, "mmrag_vision_forwards_total") == 1


def test_ttft_and_image_tokens_per_request_are_histograms(registry, metrics):
    metrics.record_completion(Usage(image_tokens=512, ttft_s=0.3))
    metrics.record_completion(Usage(image_tokens=256, ttft_s=1.5))

    assert value(registry, "mmrag_ttft_seconds_count") == 2
    assert value(registry, "mmrag_ttft_seconds_sum") == pytest.approx(1.8)
    assert value(registry, "mmrag_ttft_seconds_bucket", le="0.5") == 1
    assert value(registry, "mmrag_ttft_seconds_bucket", le="2.0") == 2
    assert value(registry, "mmrag_image_tokens_per_request_count") == 2
    assert value(registry, "mmrag_image_tokens_per_request_bucket", le="256.0") == 1
    assert value(registry, "mmrag_image_tokens_per_request_bucket", le="512.0") == 2


def test_a_completion_that_produced_no_token_has_no_ttft_to_observe(registry, metrics):
    metrics.record_completion(Usage(prompt_tokens=10, ttft_s=0.0))

    assert value(registry, "mmrag_engine_requests_total") == 1
    assert value(registry, "mmrag_ttft_seconds_count") == 0


def test_answers_are_counted_by_outcome_and_every_latency_is_observed(registry, metrics):
    d = {"tenant": "default"}
    assert value(registry, "mmrag_answers_total", outcome="ok", **d) == 0  # the series exist before the first answer
    assert value(registry, "mmrag_answers_total", outcome="error", **d) == 0

    metrics.record_answer("ok", 2.5)
    metrics.record_answer("ok", 0.7)
    metrics.record_answer("error", 30.0)

    assert value(registry, "mmrag_answers_total", outcome="ok", **d) == 2
    assert value(registry, "mmrag_answers_total", outcome="error", **d) == 1
    assert value(registry, "mmrag_request_latency_seconds_count", **d) == 3
    assert value(registry, "mmrag_request_latency_seconds_sum", **d) == pytest.approx(33.2)
    assert value(registry, "mmrag_request_latency_seconds_bucket", le="1.0", **d) == 1
    # By tenant (the tenants file's names, set at start-up: their series exist at once too).
    metrics.set_tenants(["acme"])
    assert value(registry, "mmrag_answers_total", outcome="refused", tenant="acme") == 0
    metrics.record_answer("refused", tenant="acme")
    metrics.record_admission_wait(0.02, tenant="acme")
    assert value(registry, "mmrag_answers_total", outcome="refused", tenant="acme") == 1
    assert value(registry, "mmrag_admission_wait_seconds_count", tenant="acme") == 1
    assert value(registry, "mmrag_answers_total", outcome="refused", **d) == 0


# --- scheduler ---------------------------------------------------------------------------------------------


def test_draining_the_scheduler_observes_its_lists_and_empties_them(registry, metrics):
    stats = SchedulerStats(queue_waits_s=[0.002, 0.3, 1.5], group_sizes=[3, 1])

    metrics.drain_scheduler(stats)

    assert stats.queue_waits_s == [] and stats.group_sizes == []
    assert value(registry, "mmrag_queue_wait_seconds_count") == 3
    assert value(registry, "mmrag_queue_wait_seconds_bucket", le="0.005") == 1
    assert value(registry, "mmrag_queue_wait_seconds_bucket", le="0.5") == 2
    assert value(registry, "mmrag_scheduler_group_size_count") == 2
    assert value(registry, "mmrag_scheduler_group_size_sum") == 4

    metrics.drain_scheduler(stats)  # nothing new: nothing observed twice
    assert value(registry, "mmrag_queue_wait_seconds_count") == 3


def test_scheduler_counts_become_counters_that_grow_by_the_difference_since_the_last_drain(registry, metrics):
    stats = SchedulerStats(submitted=5, dispatched=4, fairness_overrides=1, fcfs_fallbacks=0, gated=2)
    metrics.drain_scheduler(stats)
    stats.submitted, stats.dispatched, stats.fcfs_fallbacks = 9, 9, 3
    metrics.drain_scheduler(stats)
    metrics.drain_scheduler(stats)  # draining again adds nothing

    assert value(registry, "mmrag_scheduler_submitted_total") == 9
    assert value(registry, "mmrag_scheduler_dispatched_total") == 9
    assert value(registry, "mmrag_scheduler_fairness_overrides_total") == 1
    assert value(registry, "mmrag_scheduler_fcfs_fallbacks_total") == 3
    assert value(registry, "mmrag_scheduler_gated_total") == 2


def test_a_new_scheduler_counts_from_zero_and_the_counters_keep_growing(registry, metrics):
    metrics.drain_scheduler(SchedulerStats(submitted=10, dispatched=10))
    metrics.drain_scheduler(SchedulerStats(submitted=3, dispatched=2))  # e.g. the app rebuilt its scheduler

    assert value(registry, "mmrag_scheduler_submitted_total") == 13
    assert value(registry, "mmrag_scheduler_dispatched_total") == 12


def test_dispatched_image_tokens_are_counted_by_tier_and_by_pooling(registry, metrics):
    standard, low = ResolutionPolicy(3136, 200704), ResolutionPolicy(3136, 200704, pool=2)
    stats = SchedulerStats(image_tokens_by_policy=[(standard, 256), (standard, 512), (low, 64), (None, 10)])
    metrics.drain_scheduler(stats)

    # No tiers set yet: the tier label is the policy's own string.
    assert value(registry, "mmrag_tier_image_tokens_per_request_count", tier="px3136-200704") == 2
    assert value(registry, "mmrag_tier_image_tokens_per_request_sum", tier="px3136-200704") == 768
    assert value(registry, "mmrag_tier_image_tokens_per_request_count", tier="px3136-200704-pool2") == 1
    assert value(registry, "mmrag_tier_image_tokens_per_request_count", tier="unknown") == 1
    assert value(registry, "mmrag_pooling_image_tokens_total", pooled="false") == 778
    assert value(registry, "mmrag_pooling_image_tokens_total", pooled="true") == 64
    assert stats.image_tokens_by_policy == []

    metrics.set_tiers(Tiers({"standard": standard, "low": low}))
    metrics.drain_scheduler(SchedulerStats(image_tokens_by_policy=[(low, 64), (ResolutionPolicy(1, 2), 1)]))
    assert value(registry, "mmrag_tier_image_tokens_per_request_count", tier="low") == 1
    assert value(registry, "mmrag_tier_image_tokens_per_request_count", tier="other") == 1


def test_every_configured_tier_outcome_and_pooling_has_a_series_at_zero_before_any_request(registry, metrics):
    """Issue 23: the tier histogram had no series until a plan asked for a tier, so its dashboard panel showed
    "no data" on a fresh server. The app sets the tiers at start-up (wiring.build_services)."""
    from mmrag.core.settings import Settings
    from serving.metrics import ANSWER_OUTCOMES

    tiers = Settings().vision.tier_table
    metrics.set_tiers(tiers)
    assert len(tiers.policies) >= 3  # standard, low, high
    for name in tiers.policies:
        assert value(registry, "mmrag_tier_image_tokens_per_request_count", tier=name) == 0
        assert value(registry, "mmrag_tier_image_tokens_per_request_bucket", tier=name, le="+Inf") == 0
    for outcome in ANSWER_OUTCOMES:
        assert value(registry, "mmrag_answers_total", outcome=outcome, tenant="default") == 0
    for pooled in ("true", "false"):
        assert value(registry, "mmrag_pooling_image_tokens_total", pooled=pooled) == 0


def test_the_kv_residency_estimate_and_the_capacity_are_gauges(registry, metrics):
    metrics.drain_scheduler(SchedulerStats(kv_image_tokens=4096, kv_capacity_tokens=32768))

    assert value(registry, "mmrag_kv_image_tokens_resident") == 4096
    assert value(registry, "mmrag_kv_capacity_tokens") == 32768


def test_the_warm_set_is_a_pair_of_gauges(registry, metrics):
    metrics.set_warm_set(pages=12, tokens=3072)
    metrics.set_warm_set(pages=8, tokens=2048)  # a smaller warm set replaces the first

    assert value(registry, "mmrag_warm_set_pages") == 8
    assert value(registry, "mmrag_warm_set_tokens") == 2048


# --- feature stores ---------------------------------------------------------------------------------------

POLICY = ResolutionPolicy(3136, 200704)


def key(i: int) -> ImageKey:
    return ImageKey(ContentHash(hashlib.sha256(str(i).encode()).hexdigest()), EncoderVersion("cd" * 8), POLICY)


def encoded(n: int = 16) -> EncodedImage:
    return EncodedImage(torch.zeros(n, 32), torch.tensor([[1, 8, 8]], dtype=torch.int64))


def test_feature_store_counts_are_read_at_scrape_time_and_summed_by_backend(registry, metrics, tmp_path, redis_url):
    disk_a, disk_b = DiskFeatureStore(tmp_path / "a"), DiskFeatureStore(tmp_path / "b")
    redis_store = RedisFeatureStore(redis_url, prefix="test:metrics:")
    redis_store.client.flushdb()
    for store in (disk_a, disk_b, redis_store, disk_a):  # registering a store twice counts it once
        metrics.register_store(store)
    assert value(registry, "mmrag_feature_store_lookups_total", backend="disk") == 0

    # The stores are used after registration: the collector reads their StoreStats when scraped.
    disk_a.put(key(1), encoded())
    assert disk_a.get(key(1)) is not None and disk_a.get(key(2)) is None
    assert disk_b.get(key(3)) is None
    redis_store.put(key(4), encoded())
    assert redis_store.get(key(4)) is not None

    assert value(registry, "mmrag_feature_store_lookups_total", backend="disk") == 3
    assert value(registry, "mmrag_feature_store_hits_total", backend="disk") == 1
    assert value(registry, "mmrag_feature_store_bytes_read_total", backend="disk") == disk_a.stats.bytes_read > 0
    assert value(registry, "mmrag_feature_store_writes_total", backend="disk") == 1
    assert value(registry, "mmrag_feature_store_lookups_total", backend="redis") == 1
    assert value(registry, "mmrag_feature_store_hits_total", backend="redis") == 1
    assert value(registry, "mmrag_feature_store_bytes_read_total", backend="redis") == redis_store.stats.bytes_read


# --- remote replicas --------------------------------------------------------------------------------------

# A stand-in for a `vllm serve` replica: its /metrics text, trimmed from a real vLLM 0.32 replica of the tiny
# model (same HELP/TYPE lines, `_created` gauges and labels), with non-zero values. The collector under test
# only fetches and parses this text, so a canned copy exercises it fully without starting vLLM.
CANNED_VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 4096.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 1.79598168638263e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 3072.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="Qwen/Qwen2-VL-2B-Instruct"} 1.7959816863826427e+09
"""


class _ReplicaStandIn(BaseHTTPRequestHandler):
    """/metrics answers the canned text; /broken/metrics answers 500 (a replica that is up but failing)."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path == "/metrics":
            body, status = CANNED_VLLM_METRICS.encode(), 200
        elif self.path == "/broken/metrics":
            body, status = b"engine dead", 500
        else:
            body, status = b"not found", 404
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def replica_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ReplicaStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_remote_replicas_are_re_exposed_under_vllm_names_with_a_replica_label(registry, metrics, replica_url):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    metrics.register_remote_replicas([replica_url, dead], timeout_s=1.0)

    samples = scrape(registry)

    labels = {"engine": "0", "model_name": "Qwen/Qwen2-VL-2B-Instruct", "replica": replica_url}
    assert samples["vllm:kv_cache_usage_perc"] == [(labels, 0.25)]
    assert samples["vllm:prefix_cache_queries_total"] == [(labels, 4096.0)]
    assert samples["vllm:prefix_cache_hits_total"] == [(labels, 3072.0)]
    assert "vllm:num_requests_running" not in samples  # only the three families the dashboards use
    assert "vllm:prefix_cache_hits_created" not in samples
    assert {lab["replica"]: v for lab, v in samples["mmrag_replica_up"]} == {replica_url: 1.0, dead: 0.0}
    errors = {lab["replica"]: v for lab, v in samples["mmrag_replica_scrape_errors_total"]}
    assert errors == {replica_url: 0.0, dead: 1.0}  # the dead replica was skipped and counted, in this scrape


def test_each_scrape_that_misses_a_replica_counts_one_error(registry, metrics, replica_url):
    broken = f"{replica_url}/broken"  # up, but its /metrics answers 500
    metrics.register_remote_replicas([replica_url, broken], timeout_s=1.0)

    generate_latest(registry)
    generate_latest(registry)
    samples = scrape(registry)  # the third scrape: every scrape fetches every replica again

    errors = {lab["replica"]: v for lab, v in samples["mmrag_replica_scrape_errors_total"]}
    assert errors == {broken: 3.0, replica_url: 0.0}
    assert [v for lab, v in samples["vllm:prefix_cache_hits_total"] if lab["replica"] == replica_url] == [3072.0]
    assert {lab["replica"] for lab, _ in samples["vllm:prefix_cache_hits_total"]} == {replica_url}


def test_remote_replicas_next_to_in_process_vllm_metrics_fail_with_the_reason(registry, metrics):
    # Stand-in for the family vLLM's in-process engine registers in the same registry.
    Gauge("vllm:kv_cache_usage_perc", "registered by an in-process vLLM engine", registry=registry)

    with pytest.raises(ValueError, match="in-process vLLM engine exports them itself"):
        metrics.register_remote_replicas(["http://127.0.0.1:1"])


# --- the FastAPI app --------------------------------------------------------------------------------------


def test_instrumented_app_serves_http_metrics_except_for_metrics_and_healthz(registry, metrics):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/items/{item_id}")
    def item(item_id: int) -> dict:
        return {"id": item_id}

    metrics.instrument_app(app)
    metrics.record_answer("ok", 1.0)
    with TestClient(app) as client:
        for i in range(3):
            assert client.get(f"/items/{i}").status_code == 200
        assert client.get("/healthz").status_code == 200
        assert client.get("/metrics").status_code == 200
        resp = client.get("/metrics")

    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = parse_samples(resp.text)
    requests = {(lab["handler"], lab["method"], lab["status"]): v for lab, v in samples["mmrag_http_requests_total"]}
    assert requests == {("/items/{item_id}", "GET", "2xx"): 3.0}  # templated handler; no /metrics, no /healthz
    handlers = {lab["handler"] for name, rows in samples.items() if "_http_" in name for lab, _ in rows
                if "handler" in lab}
    assert handlers == {"/items/{item_id}"}
    assert samples["mmrag_http_request_duration_highr_seconds_count"] == [({}, 3.0)]  # no handler label; 3, not 5
    assert samples["mmrag_answers_total"] == [({"outcome": o, "tenant": "default"}, v) for o, v in (
        ("ok", 1.0), ("error", 0.0), ("refused", 0.0), ("cancelled", 0.0))]
    assert "/metrics" not in {r.path for r in app.routes if getattr(r, "include_in_schema", False)}
