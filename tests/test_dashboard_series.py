"""Every series a dashboard panel or an alert rule queries is on a fresh server's /metrics before any question:
labelled ones for every known value (configured tiers, answer outcomes, pooling, the store's backend), at 0.

Otherwise a panel shows "no data" until traffic happens to touch each label value, and rate() has no zero to
start from. The server is the real app (`mmrag serve`'s) over the session's `vllm serve` replica, so vLLM's own
families come through the path the deployment uses (re-exposed from the replica, serving/metrics.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import yaml

from serving.dashboards import dashboard_expressions
from serving.metrics import ANSWER_OUTCOMES, Samples, parse_samples
from tests.conftest import KV_EVENTS, copy_corpus

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yml"

# A metric name in PromQL: ours or vLLM's, not a recording rule's (``job:mmrag_...:rate5m``), with its matchers.
SELECTOR = re.compile(r"(?<![\w:])((?:mmrag_|vllm:)[\w:]*)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*=\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|group_left)\s*\(([^)]*)\)")
ADDED_BY_PROMETHEUS = {"job", "instance", "le"}  # le: every bucket sample has it

# Series whose very labels name what they report, present only when it is true: pages of an encoder other
# than the serving one (servable="false", labelled with that encoder's version). Absent is the alert's "no".
ONLY_WHEN_TRUE = {("mmrag_indexed_pages", (("servable", "false"),))}


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def missing_series(expressions: list[str], samples: Samples, known: dict[str, tuple[str, ...]]) -> list[str]:
    """What ``expressions`` query that ``samples`` lack: a selector without a series, a grouping label no
    selected series carries, or a known value of such a label without its series."""
    missing = []
    for expr in expressions:
        selected = []
        for name, matchers in SELECTOR.findall(expr):
            wanted = tuple(sorted(MATCHER.findall(matchers)))
            if (name, wanted) in ONLY_WHEN_TRUE:
                continue
            rows = [labels for labels, _ in samples.get(name, []) if dict(wanted).items() <= labels.items()]
            if not rows:
                missing.append(f"{name}{{{matchers}}} in {expr!r}")
            selected.append((name, rows))
        for grouping in GROUPING.findall(expr):
            for label in {g.strip() for g in grouping.split(",")} - ADDED_BY_PROMETHEUS:
                carrying = [(name, rows) for name, rows in selected if any(label in r for r in rows)]
                if not carrying:
                    missing.append(f"no series with label {label!r} in {expr!r}")
                for name, rows in carrying:
                    missing += [f"{name}{{{label}={value!r}}}" for value in known.get(label, ())
                                if not any(r.get(label) == value for r in rows)]
    return missing


async def test_every_series_a_panel_or_an_alert_queries_is_served_from_start_up(engine_settings, ingested,
                                                                                 vllm_server, tmp_path):
    from mmrag import wiring

    copy_corpus(engine_settings, tmp_path)
    settings = engine_settings.replace(**{"data_dir": tmp_path, "engine_urls": [vllm_server],
                                                  "kv_events_endpoints": [KV_EVENTS[vllm_server]],
                                                  "warm_top": 0})  # not one prefill: nothing has been asked
    app = wiring.create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            resp = await client.get("/metrics")
    assert resp.status_code == 200
    samples = parse_samples(resp.text)
    known = {"tier": tuple(settings.vision.tier_table.policies), "outcome": ANSWER_OUTCOMES,
             "pooled": ("true", "false"), "backend": ("disk",)}

    assert missing_series(dashboard_expressions() + rule_expressions(), samples, known) == []
    assert samples["mmrag_engine_requests_total"] == [({}, 0.0)]  # indeed before any question


def test_the_check_sees_a_tier_without_its_series():
    """The check itself: a histogram queried by tier, one configured tier not yet observed."""
    expr = "histogram_quantile(0.5, sum by (le, tier) (rate(mmrag_tier_image_tokens_per_request_bucket[1m])))"
    samples = {"mmrag_tier_image_tokens_per_request_bucket": [({"tier": "standard", "le": "+Inf"}, 0.0)]}
    assert missing_series([expr], samples, {"tier": ("standard", "high")}) == [
        "mmrag_tier_image_tokens_per_request_bucket{tier='high'}"]
    assert missing_series([expr], {}, {}) == [
        f"mmrag_tier_image_tokens_per_request_bucket{{}} in {expr!r}", f"no series with label 'tier' in {expr!r}"]
