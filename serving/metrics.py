"""Every Prometheus name mmrag exports, in one place (prefix ``mmrag_``).

The rest of the code counts into plain dataclasses (``Usage``, ``SchedulerStats``, ``StoreStats``); this
module alone turns them into Prometheus series. Counters are in tokens or items; rates and ratios are left to
PromQL (serving/dashboards.py), so any window and any number of replicas aggregate correctly.

Engine-side KV usage and prefix-cache counters use vLLM's own names, so one dashboard query covers both
engine modes:

- in-process engine: vLLM's AsyncLLM registers ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``
  and ``vllm:prefix_cache_hits_total`` (labels ``model_name``, ``engine``) in prometheus_client's global
  ``REGISTRY``; ``VllmFromGlobalRegistry`` re-exposes every ``vllm:*`` family on an app's own registry.
- remote replicas: ``register_remote_replicas(urls)`` re-exposes those three families, fetched from each
  replica's /metrics at scrape time, under the same names with a ``replica`` label added.

Either way a label value that is an absolute path is cut to its last part: vLLM's ``model_name`` is the
checkpoint folder when no served name is set, and /metrics (unauthenticated) must not map the server's disk.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from mmrag.core.engine import ImageInput, Usage
from mmrag.core.keys import ResolutionPolicy, Tiers
from mmrag.core.payload import EncoderScope
from mmrag.core.settings import DEFAULT_TENANT
from serving.scheduler import SchedulerStats

if TYPE_CHECKING:
    from mmrag.adapters.store import FeatureStore

log = logging.getLogger(__name__)

# --- names (families: a counter's samples carry `_total`, a histogram's `_bucket`/`_sum`/`_count`) ---------

ENGINE_REQUESTS = "mmrag_engine_requests"
PROMPT_TOKENS = "mmrag_prompt_tokens"
PROMPT_TOKENS_CACHED = "mmrag_prompt_tokens_cached"
IMAGE_TOKENS = "mmrag_image_tokens"
IMAGE_TOKENS_CACHED = "mmrag_image_tokens_cached"
COMPLETION_TOKENS = "mmrag_completion_tokens"
VISION_FORWARDS = "mmrag_vision_forwards"
ENGINE_REQUESTS_BY_IMAGE_INPUT = "mmrag_engine_requests_by_image_input"
TTFT = "mmrag_ttft_seconds"
IMAGE_TOKENS_PER_REQUEST = "mmrag_image_tokens_per_request"
# Issue 16, the image-token budget: per dispatched plan, by resolution tier and by pooling; and the scheduler's
# estimate of the image tokens resident in the engine's KV cache (serving/scheduler.KVResidency), of its capacity.
TIER_IMAGE_TOKENS_PER_REQUEST = "mmrag_tier_image_tokens_per_request"
POOLING_IMAGE_TOKENS = "mmrag_pooling_image_tokens"
KV_IMAGE_TOKENS = "mmrag_kv_image_tokens_resident"
KV_CAPACITY_TOKENS = "mmrag_kv_capacity_tokens"
SCHEDULER_MAX_CONCURRENCY = "mmrag_scheduler_max_concurrency"

ANSWERS = "mmrag_answers"
ANSWER_OUTCOMES = ("ok", "error", "refused", "cancelled")
REQUEST_LATENCY = "mmrag_request_latency_seconds"
ADMISSION_WAIT = "mmrag_admission_wait_seconds"
# Issue 40: answer-cache lookups (rag/answer_cache.py), by outcome; sampled answers are not looked up.
ANSWER_CACHE = "mmrag_answer_cache"
ANSWER_CACHE_OUTCOMES = ("hit", "miss")

QUEUE_WAIT = "mmrag_queue_wait_seconds"
GROUP_SIZE = "mmrag_scheduler_group_size"
SCHEDULER_SUBMITTED = "mmrag_scheduler_submitted"
SCHEDULER_DISPATCHED = "mmrag_scheduler_dispatched"
SCHEDULER_FAIRNESS_OVERRIDES = "mmrag_scheduler_fairness_overrides"
SCHEDULER_FCFS_FALLBACKS = "mmrag_scheduler_fcfs_fallbacks"
SCHEDULER_GATED = "mmrag_scheduler_gated"
SCHEDULER_CANCELLED_QUEUED = "mmrag_scheduler_cancelled_queued"
SCHEDULER_CANCELLED_RUNNING = "mmrag_scheduler_cancelled_running"
SCHEDULER_SHORT_DISPATCHED = "mmrag_scheduler_short_dispatched"
SCHEDULER_LONG_HELD = "mmrag_scheduler_long_held"
SCHEDULER_KEPT_HELD = "mmrag_scheduler_kept_held"

WARM_SET_PAGES = "mmrag_warm_set_pages"
WARM_SET_TOKENS = "mmrag_warm_set_tokens"
SERVING_ENCODER = "mmrag_serving_encoder"  # an info metric: the sample is mmrag_serving_encoder_info
INDEXED_PAGES = "mmrag_indexed_pages"

STORE_LOOKUPS = "mmrag_feature_store_lookups"
STORE_HITS = "mmrag_feature_store_hits"
STORE_BYTES_READ = "mmrag_feature_store_bytes_read"
STORE_WRITES = "mmrag_feature_store_writes"
STORE_BYTES_WRITTEN = "mmrag_feature_store_bytes_written"

REPLICA_UP = "mmrag_replica_up"
REPLICA_SCRAPE_ERRORS = "mmrag_replica_scrape_errors"
# Issue 45, routing by the replicas' KV events (serving/kv_events.py): events received per replica, whether they
# are routing's word now (synced) or it falls back to the learned table, what the index holds, and the routes
# each source decided.
KV_EVENTS = "mmrag_kv_events"
KV_EVENTS_SYNCED = "mmrag_kv_events_synced"
KV_EVENTS_BLOCKS = "mmrag_kv_events_index_blocks"
KV_EVENTS_PREFIXES = "mmrag_kv_events_index_prefixes"
KV_EVENTS_RESYNCS = "mmrag_kv_events_resyncs"
ROUTES = "mmrag_routes"

HTTP_NAMESPACE = "mmrag"  # the instrumentator's series: mmrag_http_requests_total, mmrag_http_request_duration_*

# vLLM's own families (its names, not ours): re-exposed from remote replicas, registered by vLLM in-process.
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # gauge, 0..1 despite the name
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries"  # counter, tokens
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits"  # counter, tokens
_VLLM_FAMILIES = {VLLM_KV_USAGE: "gauge", VLLM_PREFIX_QUERIES: "counter", VLLM_PREFIX_HITS: "counter"}

UNINSTRUMENTED_HANDLERS = ("/metrics", "/healthz")

# --- buckets ---------------------------------------------------------------------------------------------

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
_QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8)
_GROUP_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
_IMAGE_TOKEN_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

_SCHEDULER_COUNTS = {
    "submitted": (SCHEDULER_SUBMITTED, "Plans submitted to the scheduler."),
    "dispatched": (SCHEDULER_DISPATCHED, "Plans the scheduler sent to the engine."),
    "fairness_overrides": (SCHEDULER_FAIRNESS_OVERRIDES, "Dispatch rounds where an overdue plan overrode the policy."),
    "fcfs_fallbacks": (SCHEDULER_FCFS_FALLBACKS, "Dispatch rounds in plain FCFS because the queue was over its cap."),
    "gated": (SCHEDULER_GATED, "Times a plan was held back to wait for its group leader's prefill."),
    "cancelled_queued": (SCHEDULER_CANCELLED_QUEUED, "Plans taken out of the queue because their client left."),
    "cancelled_running": (SCHEDULER_CANCELLED_RUNNING, "Engine requests aborted because their client left."),
    "short_dispatched": (SCHEDULER_SHORT_DISPATCHED, "Plans dispatched from the short queue (mixed resolutions)."),
    "long_held": (SCHEDULER_LONG_HELD, "Times a long plan was held back to keep the short plans' slots free."),
    "kept_held": (SCHEDULER_KEPT_HELD, "Times a plan was held back to keep slots free for another tenant's next plans."),
}

UNKNOWN_TIER = "unknown"  # image keys without a resolution policy (test doubles)


def tier_label(policy: ResolutionPolicy | None, tiers: Tiers | None = None) -> str:
    """The ``tier`` label of image tokens made under ``policy``: its tier's name when the tiers are known
    (Metrics.set_tiers), else the policy's own string (``px3136-200704``): few values either way, one per
    configured policy."""
    if policy is None:
        return UNKNOWN_TIER
    return tiers.name_of(policy) if tiers is not None else str(policy)


def pooled_label(policy: ResolutionPolicy | None) -> str:
    return str(bool(policy is not None and policy.pooled)).lower()


class Metrics:
    """The app's metrics, registered in ``registry`` (the app passes prometheus_client's global REGISTRY)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self._engine_requests = Counter(ENGINE_REQUESTS, "Engine requests (prompt plans) completed.", registry=r)
        self._prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens sent to the engine.", registry=r)
        self._prompt_cached = Counter(PROMPT_TOKENS_CACHED, "Prompt tokens whose KV came from the prefix cache.",
                                      registry=r)
        self._image_tokens = Counter(IMAGE_TOKENS, "Image tokens in prompts sent to the engine.", registry=r)
        self._image_cached = Counter(IMAGE_TOKENS_CACHED, "Image tokens whose KV came from the prefix cache.",
                                     registry=r)
        self._completion_tokens = Counter(COMPLETION_TOKENS, "Tokens generated.", registry=r)
        self._vision_forwards = Counter(VISION_FORWARDS, "Vision-encoder forwards done at request time "
                                        "(0 while every page was ingested ahead).", registry=r)
        self._by_image_input = Counter(ENGINE_REQUESTS_BY_IMAGE_INPUT, "Engine requests with images, by the form "
                                       "that sent them (MMRAG_IMAGE_INPUT): embeds (stored image tokens) or pixels "
                                       "(vLLM's own encoder; pooled tiers are always embeds).", ["form"], registry=r)
        for form in ImageInput:
            self._by_image_input.labels(form.value)
        self._ttft = Histogram(TTFT, "Time to first token per engine request.", buckets=_TTFT_BUCKETS, registry=r)
        self._image_per_request = Histogram(IMAGE_TOKENS_PER_REQUEST, "Image tokens per engine request.",
                                            buckets=_IMAGE_TOKEN_BUCKETS, registry=r)
        self._tier_per_request = Histogram(TIER_IMAGE_TOKENS_PER_REQUEST, "Image tokens per plan dispatched by the "
                                           "scheduler, by resolution tier (a plan mixing tiers: once per tier).",
                                           ["tier"], buckets=_IMAGE_TOKEN_BUCKETS, registry=r)
        self._pooling_tokens = Counter(POOLING_IMAGE_TOKENS, "Image tokens in plans dispatched by the scheduler, "
                                       "pooled (2x2 after the projector) or not.", ["pooled"], registry=r)
        for pooled in ("true", "false"):
            self._pooling_tokens.labels(pooled)
        self._kv_image = Gauge(KV_IMAGE_TOKENS, "Image tokens resident in the engine's KV cache, estimated by the "
                               "scheduler from the prompts it sent (an LRU model of the prefix cache; see "
                               "serving/scheduler.KVResidency for its error).", registry=r)
        self._kv_capacity = Gauge(KV_CAPACITY_TOKENS, "The engine's KV cache capacity in tokens.", registry=r)
        self._max_concurrency = Gauge(SCHEDULER_MAX_CONCURRENCY, "Plans the scheduler lets into the engine at "
                                      "once: MMRAG_MAX_CONCURRENCY, or the engine's batch (its max_num_seqs, the "
                                      "replicas' sum) where that is 0.", registry=r)
        self._tiers: Tiers | None = None

        # By tenant: the tenants file's names (or `default`), a bounded set: a request's tenant is the one its
        # key authenticates, never a value the client chooses.
        self._answers = Counter(ANSWERS, "Questions to /v1/ask, by outcome: ok | error | refused (429: the queue "
                                "behind MMRAG_MAX_QUESTIONS_IN_FLIGHT full, or too slow) | cancelled (the client "
                                "left), and tenant.", ["outcome", "tenant"], registry=r)
        self._latency = Histogram(REQUEST_LATENCY, "End-to-end latency of /v1/ask, errors included, by tenant.",
                                  ["tenant"], buckets=_LATENCY_BUCKETS, registry=r)
        self._admission_wait = Histogram(ADMISSION_WAIT, "Time an admitted question waited for its place among "
                                         "MMRAG_MAX_QUESTIONS_IN_FLIGHT (0 when one was free), by tenant.",
                                         ["tenant"], buckets=(0, *_LATENCY_BUCKETS), registry=r)
        self.set_tenants((DEFAULT_TENANT,))
        self._answer_cache = Counter(ANSWER_CACHE, "Answer-cache lookups, by outcome: hit (the answer served from "
                                     "the cache, no engine request) | miss (a corrupt entry or a failed store "
                                     "read included).", ["outcome"], registry=r)
        for outcome in ANSWER_CACHE_OUTCOMES:
            self._answer_cache.labels(outcome)

        self._queue_wait = Histogram(QUEUE_WAIT, "Time a plan waited in the scheduler queue.",
                                     buckets=_QUEUE_WAIT_BUCKETS, registry=r)
        self._group_size = Histogram(GROUP_SIZE, "Plans sharing the leading image of a dispatched plan.",
                                     buckets=_GROUP_SIZE_BUCKETS, registry=r)
        self._scheduler_counters = {f: Counter(name, doc, registry=r) for f, (name, doc) in _SCHEDULER_COUNTS.items()}
        self._scheduler_seen: SchedulerStats | None = None
        self._scheduler_last = dict.fromkeys(_SCHEDULER_COUNTS, 0)
        self._scheduler_lock = threading.Lock()

        self._warm_pages = Gauge(WARM_SET_PAGES, "Pages in the current warm set.", registry=r)
        self._warm_tokens = Gauge(WARM_SET_TOKENS, "Image tokens in the current warm set.", registry=r)

        self._encoder = Info(SERVING_ENCODER, "The vision encoder whose image tokens this server feeds: its "
                             "version, model family and resolution policy.", registry=r)
        self._indexed_pages = Gauge(INDEXED_PAGES, "Indexed pages by the encoder that made their image tokens, at "
                                    "start-up; servable=false pages (another encoder's) are never served.",
                                    ["encoder_version", "policy", "servable"], registry=r)

        self._stores = _StoreCollector()
        r.register(self._stores)
        self._replicas: _ReplicaCollector | None = None
        self._own = [c for c in vars(self).values() if isinstance(c, (Counter, Gauge, Histogram, Info))]
        self._own += list(self._scheduler_counters.values())

    # -- per engine request and per answer --

    def record_completion(self, usage: Usage) -> None:
        """One engine request (a sub-question's plan). Warm-up prefills should not be recorded here: they
        are not user traffic and would skew the hit rates."""
        self._engine_requests.inc()
        self._prompt_tokens.inc(usage.prompt_tokens)
        self._prompt_cached.inc(usage.cached_tokens)
        self._image_tokens.inc(usage.image_tokens)
        self._image_cached.inc(usage.cached_image_tokens)
        self._completion_tokens.inc(usage.completion_tokens)
        self._vision_forwards.inc(usage.vision_encodes)
        if usage.image_input and usage.image_tokens:
            self._by_image_input.labels(usage.image_input).inc()
        self._image_per_request.observe(usage.image_tokens)
        if usage.ttft_s > 0:  # 0 means no token came back: there is no first-token time to observe
            self._ttft.observe(usage.ttft_s)

    def set_tenants(self, tenants: Iterable[str]) -> None:
        """Every tenant's answer, latency and admission-wait series exist from the start (a zero for rate() to
        start from; a dashboard panel has data before the tenant's first question)."""
        for tenant in tenants:
            for outcome in ANSWER_OUTCOMES:
                self._answers.labels(outcome, tenant)
            self._latency.labels(tenant)
            self._admission_wait.labels(tenant)

    def record_answer(self, outcome: str, latency_s: float | None = None, tenant: str = DEFAULT_TENANT) -> None:
        """One /v1/ask question by outcome and tenant; the latency of those the server worked on to the end."""
        if outcome not in ANSWER_OUTCOMES:
            raise ValueError(f"answer outcome {outcome!r}: one of {ANSWER_OUTCOMES}")
        self._answers.labels(outcome, tenant).inc()
        if latency_s is not None:
            self._latency.labels(tenant).observe(latency_s)

    def record_admission_wait(self, waited_s: float, tenant: str = DEFAULT_TENANT) -> None:
        self._admission_wait.labels(tenant).observe(waited_s)

    def record_answer_cache(self, outcome: str) -> None:
        """One answer-cache lookup (rag/answer_cache.AnswerCache's ``on_lookup``): hit or miss."""
        if outcome not in ANSWER_CACHE_OUTCOMES:
            raise ValueError(f"answer-cache outcome {outcome!r}: one of {ANSWER_CACHE_OUTCOMES}")
        self._answer_cache.labels(outcome).inc()

    # -- scheduler --

    def drain_scheduler(self, stats: SchedulerStats) -> None:
        """Observe and clear the scheduler's wait and group-size lists; add its counts' growth to counters.

        Call it from the event loop after each /v1/ask (the scheduler only changes while plans run). Counts
        are exported by delta from the last call; a different stats object (a new scheduler) starts from 0.
        """
        with self._scheduler_lock:
            for wait in _drain(stats.queue_waits_s):
                self._queue_wait.observe(wait)
            for size in _drain(stats.group_sizes):
                self._group_size.observe(size)
            for policy, tokens in _drain(stats.image_tokens_by_policy):
                self._tier_per_request.labels(tier_label(policy, self._tiers)).observe(tokens)
                self._pooling_tokens.labels(pooled_label(policy)).inc(tokens)
            self._kv_image.set(stats.kv_image_tokens)
            self._kv_capacity.set(stats.kv_capacity_tokens)
            self._max_concurrency.set(stats.max_concurrency)
            if stats is not self._scheduler_seen:
                self._scheduler_seen = stats
                self._scheduler_last = dict.fromkeys(_SCHEDULER_COUNTS, 0)
            for field, counter in self._scheduler_counters.items():
                now = getattr(stats, field)
                counter.inc(max(now - self._scheduler_last[field], 0))
                self._scheduler_last[field] = now

    def set_tiers(self, tiers: Tiers) -> None:
        """Name the ``tier`` label by the configured tiers (Settings.tier_table) instead of by policy; each
        tier's series exists from now on, at 0, so its dashboard panel and rate() have a start before any
        plan asks for that tier."""
        self._tiers = tiers
        for name in tiers.policies:
            self._tier_per_request.labels(name)

    # -- warm set --

    def set_warm_set(self, pages: int, tokens: int) -> None:
        """The warm set now held in the engine's prefix cache (from WarmReport: len(warmed), warmed_tokens)."""
        self._warm_pages.set(pages)
        self._warm_tokens.set(tokens)

    # -- the encoder and the index --

    def set_encoder(self, serving: EncoderScope, family: str, indexed: Mapping[EncoderScope, int]) -> None:
        """The serving encoder, and the indexed pages per encoder (a mismatch alert fires on servable=false)."""
        self._encoder.info({"version": serving.version, "family": family, "policy": str(serving.policy)})
        self._indexed_pages.clear()
        for scope, pages in indexed.items():
            self._indexed_pages.labels(scope.version, str(scope.policy), str(scope == serving).lower()).set(pages)

    # -- feature stores --

    def register_store(self, store: FeatureStore) -> None:
        """Export the store's StoreStats by backend, read at scrape time. Same-backend stores are summed."""
        self._stores.add(store)

    # -- remote replicas --

    def register_remote_replicas(self, urls: Sequence[str], *, timeout_s: float = 2.0) -> None:
        """Re-expose each replica's KV usage and prefix-cache counters, fetched at scrape time.

        A replica that does not answer within ``timeout_s`` (or answers garbage) is left out of that scrape
        and counted in ``mmrag_replica_scrape_errors_total{replica}``. The fetch is synchronous: the
        instrumentator's /metrics handler is a plain ``def``, which FastAPI runs in its thread pool, so the
        event loop never waits on a replica.
        """
        if self._replicas is not None:
            raise RuntimeError("remote replicas are already registered with these metrics; register them once")
        urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not urls:
            raise ValueError("register_remote_replicas needs at least one replica URL (MMRAG_ENGINE_URLS)")
        collector = _ReplicaCollector(urls, timeout_s)
        try:
            self.registry.register(collector)
        except ValueError as exc:
            raise ValueError(
                f"{exc}. The vllm:* families are already in this registry, so an in-process vLLM engine exports "
                "them itself: register remote replicas only when the engine is remote (MMRAG_ENGINE_URLS)."
            ) from exc
        self._replicas = collector

    # -- routing by KV events --

    def register_kv_events(self, stats: Callable[[], Mapping[str, Mapping[str, Any]]],
                           routed: Mapping[str, int]) -> None:
        """Export the KV events index (``stats``: serving/kv_events.KvEventIndex.stats) and the routes decided
        by each source (``routed``: source -> count, read at scrape time)."""
        self.registry.register(_KvEventsCollector(stats, routed))

    # -- the FastAPI app --

    def instrument_app(self, app: Any) -> None:
        """HTTP metrics for every handler but /metrics and /healthz, and /metrics serving this registry.

        The instrumentator's /metrics always answers the classic text format. Keep it that way: with
        OpenMetrics negotiation, prometheus_client 0.26 rewrites the `vllm:` samples to `vllm_`
        (prometheus/client_python#1177) and the vLLM panels would go blank.
        """
        from prometheus_fastapi_instrumentator import Instrumentator

        # Anchored: a bare "/metrics" pattern would also drop a future "/metrics-foo" handler.
        excluded = [f"^{h}$" for h in UNINSTRUMENTED_HANDLERS]
        instrumentator = Instrumentator(excluded_handlers=excluded, registry=self.registry)
        instrumentator.instrument(app, metric_namespace=HTTP_NAMESPACE)
        instrumentator.expose(app, endpoint="/metrics", include_in_schema=False)

    def unregister(self) -> None:
        """Remove every collector this object registered (an app factory called twice on one registry)."""
        for collector in [*self._own, self._stores, self._replicas]:
            if collector is not None:
                self.registry.unregister(collector)
        if self._replicas is not None:
            self._replicas.close()
            self._replicas = None


Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name (``_total``, ``_bucket``...) -> [(labels, value)]


def parse_samples(text: str) -> Samples:
    """Prometheus text exposition (any /metrics: ours, a vLLM replica's, the vision service's) parsed by
    prometheus_client's own parser: sample name -> [(labels, value)]. Raises ValueError on text it cannot read."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def sample_total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    return sum(v for have, v in samples.get(name, []) if labels.items() <= have.items())


def public_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """``labels`` with every absolute path cut to its last part (``/models/Qwen2-VL-2B`` -> ``Qwen2-VL-2B``)."""
    return {k: (PurePosixPath(v).name or v) if v.startswith("/") else v for k, v in labels.items()}


class VllmFromGlobalRegistry(Collector):
    """The ``vllm:*`` families the in-process engine registers in prometheus_client's global registry, with
    public label values (see the module docstring)."""

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if family.name.startswith("vllm:"):
                public = Metric(family.name, family.documentation, family.type, family.unit)
                public.samples = [s._replace(labels=public_labels(s.labels)) for s in family.samples]
                yield public

    def describe(self) -> Iterable[Metric]:
        return []  # the families appear only once the in-process engine starts, after the app registers this


def _drain(values: list) -> list:
    # Slice then delete the same count: an append racing with us lands after the slice and is kept.
    n = len(values)
    taken = values[:n]
    del values[:n]
    return taken


class _StoreCollector(Collector):
    """StoreStats of the registered stores, read at scrape time, summed by backend."""

    _FIELDS = {
        "lookups": (STORE_LOOKUPS, "Feature-store lookups (image tokens looked up by ImageKey)."),
        "hits": (STORE_HITS, "Feature-store lookups that found the entry."),
        "bytes_read": (STORE_BYTES_READ, "Bytes read from the feature store on hits."),
        "writes": (STORE_WRITES, "Entries written to the feature store."),
        "bytes_written": (STORE_BYTES_WRITTEN, "Bytes written to the feature store."),
    }

    def __init__(self) -> None:
        self._stores: list[FeatureStore] = []

    def add(self, store: FeatureStore) -> None:
        if not any(s is store for s in self._stores):
            self._stores.append(store)

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(name, doc, labels=["backend"]) for name, doc in self._FIELDS.values()]

    def collect(self) -> Iterable[Metric]:
        totals: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(self._FIELDS, 0))
        for store in list(self._stores):
            for field in self._FIELDS:
                totals[store.backend][field] += getattr(store.stats, field)
        for field, (name, doc) in self._FIELDS.items():
            family = CounterMetricFamily(name, doc, labels=["backend"])
            for backend in sorted(totals):
                family.add_metric([backend], totals[backend][field])
            yield family


class _KvEventsCollector(Collector):
    """The KV events index per replica and the routes by source, read at scrape time."""

    def __init__(self, stats: Callable[[], Mapping[str, Mapping[str, Any]]], routed: Mapping[str, int]) -> None:
        self._stats, self._routed = stats, routed

    def describe(self) -> Iterable[Metric]:
        return list(self._families().values())

    @staticmethod
    def _families() -> dict[str, Metric]:
        return {
            "events": CounterMetricFamily(KV_EVENTS, "KV events received from each replica.", labels=["replica"]),
            "synced": GaugeMetricFamily(KV_EVENTS_SYNCED, "1 while a replica's KV events are routing's word; 0 "
                                        "while its publisher is lost or a gap could not be replayed (routing "
                                        "falls back to the learned table).", labels=["replica", "state"]),
            "blocks": GaugeMetricFamily(KV_EVENTS_BLOCKS, "KV blocks indexed per replica.", labels=["replica"]),
            "prefixes": GaugeMetricFamily(KV_EVENTS_PREFIXES, "Leading image prefixes indexed per replica.",
                                          labels=["replica"]),
            "resyncs": CounterMetricFamily(KV_EVENTS_RESYNCS, "Replays asked of a replica's publisher (a "
                                           "reconnect or a gap).", labels=["replica"]),
            "routes": CounterMetricFamily(ROUTES, "Prompt plans routed, by what decided: the replicas' KV events, "
                                          "or the table learned from what was sent.", labels=["source"]),
        }

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        for replica, st in sorted(self._stats().items()):
            families["events"].add_metric([replica], st["events"])
            families["synced"].add_metric([replica, st["state"]], 1 if st["state"] == "synced" else 0)
            families["blocks"].add_metric([replica], st["blocks"])
            families["prefixes"].add_metric([replica], st["prefixes"])
            families["resyncs"].add_metric([replica], st["resyncs"])
        for source in ("events", "table"):
            families["routes"].add_metric([source], self._routed.get(source, 0))
        yield from families.values()


class _ReplicaCollector(Collector):
    """vLLM's KV-usage and prefix-cache families from remote replicas, with a ``replica`` label added.

    Also ``mmrag_replica_up`` and ``mmrag_replica_scrape_errors_total``, yielded after the fetches so a
    scrape's own failures are in that same scrape.
    """

    def __init__(self, urls: list[str], timeout_s: float) -> None:
        self.urls = urls
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s))
        self._errors = dict.fromkeys(urls, 0)
        self._lock = threading.Lock()  # two scrapes at once (two Prometheus servers) both count errors
        self._down: set[str] = set()  # to log a replica going down once, not at every scrape

    def describe(self) -> Iterable[Metric]:
        # Names only: lets the registry refuse a clash with in-process vllm:* without fetching anything.
        return [*self._empty_families().values(), GaugeMetricFamily(REPLICA_UP, ""),
                CounterMetricFamily(REPLICA_SCRAPE_ERRORS, "")]

    def collect(self) -> Iterator[Metric]:
        with ThreadPoolExecutor(max_workers=min(len(self.urls), 16)) as pool:
            scraped = list(pool.map(self._fetch, self.urls))
        families = self._empty_families()
        up = GaugeMetricFamily(REPLICA_UP, "1 if the replica's /metrics answered at this scrape.", labels=["replica"])
        errors = CounterMetricFamily(REPLICA_SCRAPE_ERRORS, "Failed fetches of a replica's /metrics.",
                                     labels=["replica"])
        for url, parsed in zip(self.urls, scraped):
            up.add_metric([url], 0 if parsed is None else 1)
            errors.add_metric([url], self._errors[url])
            if parsed is not None:
                self._add_samples(url, parsed, families)
        yield from families.values()
        yield up
        yield errors

    def close(self) -> None:
        self._client.close()

    @staticmethod
    def _empty_families() -> dict[str, Metric]:
        return {name: Metric(name, f"{name} of each remote vLLM replica (re-exposed by mmrag).", typ)
                for name, typ in _VLLM_FAMILIES.items()}

    def _fetch(self, url: str) -> list[Metric] | None:
        try:
            resp = self._client.get(f"{url}/metrics")
            resp.raise_for_status()
            families = list(text_string_to_metric_families(resp.text))  # parsed here: garbage is an error too
        except (httpx.HTTPError, ValueError) as exc:
            with self._lock:
                self._errors[url] += 1
            if url not in self._down:
                log.warning("replica %s: /metrics failed (%s); leaving it out until it answers", url, exc)
                self._down.add(url)
            return None
        self._down.discard(url)
        return families

    @staticmethod
    def _add_samples(url: str, scraped: list[Metric], families: dict[str, Metric]) -> None:
        for family in scraped:
            out = families.get(family.name)
            if out is None or family.type != out.type:
                continue
            wanted = f"{family.name}_total" if family.type == "counter" else family.name  # no `_created`
            for sample in family.samples:
                if sample.name == wanted:
                    out.add_sample(sample.name, {**public_labels(sample.labels), "replica": url}, sample.value)
