"""Grafana dashboards as code (grafana-foundation-sdk), rendered to JSON files committed under deploy/.

    python -m serving.dashboards --out deploy/grafana/dashboards

The panels and their PromQL are plain data (``PANELS``), so ``dashboard_expressions()`` needs no SDK and a
test can evaluate every expression against a real Prometheus. Every metric name comes from serving/metrics.
Rates use a 1-minute window and ``sum(...)`` across series, so a ratio stays right with several replicas
(ratios of sums, never averages of ratios).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from serving import metrics as m

WINDOW = "1m"
DATASOURCE_UID = "prometheus"  # deploy/grafana/provisioning/datasources/prometheus.yml names it so
DASHBOARD_UID = "mmrag-serving"
DASHBOARD_FILE = f"{DASHBOARD_UID}.json"


@dataclass(slots=True, frozen=True)
class Query:
    expr: str
    legend: str
    ref_id: str = "A"


@dataclass(slots=True, frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    max: float | None = None  # ratios are drawn on 0..1


def _rate(family: str, suffix: str = "_total") -> str:
    return f"sum(rate({family}{suffix}[{WINDOW}]))"


def _ratio(numerator: str, denominator: str) -> str:
    return f"{_rate(numerator)} / {_rate(denominator)}"


def _quantile(q: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le{by and ', ' + by}) (rate({histogram}_bucket[{WINDOW}])))"


def _quantiles(histogram: str, by: str = "") -> tuple[Query, ...]:
    """p50 and p99; ``by``: one line per value of that label."""
    legend = f" {{{{{by}}}}}" if by else ""
    return (Query(_quantile(0.5, histogram, by), f"p50{legend}", "A"),
            Query(_quantile(0.99, histogram, by), f"p99{legend}", "B"))


KV_EVENTS_PANEL = "Routing by KV events"

PANELS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Image-prefix hit rate",
        "Share of image tokens whose KV came from the prefix cache (mmrag's own accounting per request).",
        "percentunit",
        (Query(_ratio(m.IMAGE_TOKENS_CACHED, m.IMAGE_TOKENS), "image tokens cached"),),
        max=1,
    ),
    PanelSpec(
        "Vision-token cache hit rate",
        "Feature-store lookups that found the page's image tokens (no vision forward needed).",
        "percentunit",
        (Query(_ratio(m.STORE_HITS, m.STORE_LOOKUPS), "feature-store hits"),),
        max=1,
    ),
    PanelSpec(
        "Answer cache hit rate",
        "Share of answer-cache lookups served from the cache (a repeated question: no engine request at all); "
        "sampled answers (temperature > 0) are not looked up.",
        "percentunit",
        (Query(f'sum(rate({m.ANSWER_CACHE}_total{{outcome="hit"}}[{WINDOW}])) / {_rate(m.ANSWER_CACHE)}',
               "answer-cache hits"),),
        max=1,
    ),
    PanelSpec("Time to first token", "Per engine request.", "s", _quantiles(m.TTFT)),
    PanelSpec(
        "Throughput",
        "Answers to /v1/ask (by outcome) and engine requests (one per sub-question plan), per second.",
        "reqps",
        (
            Query(f"sum by (outcome) (rate({m.ANSWERS}_total[{WINDOW}]))", "answers {{outcome}}", "A"),
            Query(_rate(m.ENGINE_REQUESTS), "engine requests", "B"),
        ),
    ),
    PanelSpec(
        "Image prefill share",
        "Of the prompt tokens actually computed (not served from the prefix cache), the share that are image "
        "tokens: what prefix reuse has left to save.",
        "percentunit",
        (Query(f"({_rate(m.IMAGE_TOKENS)} - {_rate(m.IMAGE_TOKENS_CACHED)}) / "
               f"({_rate(m.PROMPT_TOKENS)} - {_rate(m.PROMPT_TOKENS_CACHED)})", "image share of computed prefill"),),
        max=1,
    ),
    PanelSpec("Scheduler queue wait", "Time a plan waited before dispatch to the engine.", "s",
              _quantiles(m.QUEUE_WAIT)),
    PanelSpec(
        "KV cache usage",
        "vLLM's KV-cache usage (0..1), mean and fullest over engines and replicas.",
        "percentunit",
        # A usage fraction is not additive: sum() over two replicas would read 120%.
        (Query(f"avg({m.VLLM_KV_USAGE})", "mean", "A"), Query(f"max({m.VLLM_KV_USAGE})", "max", "B")),
        max=1,
    ),
    PanelSpec(
        "Image tokens in the KV cache",
        "Image tokens resident in the engine's KV cache as a share of its capacity: the scheduler's estimate (an "
        "LRU model of the prefix cache over the prompts it sent, serving/scheduler.KVResidency, which states its "
        "error; warm-up prefills are not in it).",
        "percentunit",
        (Query(f"sum({m.KV_IMAGE_TOKENS}) / sum({m.KV_CAPACITY_TOKENS})", "image share of KV capacity"),),
        max=1,
    ),
    PanelSpec(
        "Image tokens per request by tier",
        "Image tokens of each plan the scheduler dispatched, by resolution tier (p50 and p99).",
        "short",
        _quantiles(m.TIER_IMAGE_TOKENS_PER_REQUEST, by="tier"),
    ),
    PanelSpec(
        "Pooled vs unpooled image tokens",
        "Image tokens per second in dispatched plans, 2x2-pooled or not.",
        "short",
        (Query(f"sum by (pooled) (rate({m.POOLING_IMAGE_TOKENS}_total[{WINDOW}]))", "pooled={{pooled}}"),),
    ),
    PanelSpec(
        "Image input form and request-time vision forwards",
        "Engine requests with images per second, by the form that sent them (MMRAG_IMAGE_INPUT: embeds, stored "
        "image tokens; pixels, encoded by vLLM itself; pooled tiers always go as embeds), and vision forwards done "
        "at request time: 0 in the embeds form once every page is ingested, images outside the cached prefix in "
        "the pixels form.",
        "reqps",
        (Query(f"sum by (form) (rate({m.ENGINE_REQUESTS_BY_IMAGE_INPUT}_total[{WINDOW}]))", "{{form}}", "A"),
         Query(_rate(m.VISION_FORWARDS), "vision forwards at request time", "B")),
    ),
    # The tenants' row (issue 41): who sends the load, who is refused, who waits. The tenant label's values are
    # the tenants file's names (serving/metrics.py), a bounded set.
    PanelSpec(
        "Questions by tenant",
        "Questions per second by tenant and outcome: ok, error, refused (429: over the tenant's share of the "
        "queue, its rate or the server's bound) and cancelled. A tenant flooding the server shows as its own "
        "refusals, not the others'.",
        "reqps",
        (Query(f"sum by (tenant, outcome) (rate({m.ANSWERS}_total[{WINDOW}]))", "{{tenant}} {{outcome}}"),),
    ),
    PanelSpec(
        "Admission wait by tenant",
        "How long each tenant's admitted questions waited for a place among MMRAG_MAX_QUESTIONS_IN_FLIGHT: with "
        "fair share a tenant within its share waits behind nobody else's questions.",
        "s",
        _quantiles(m.ADMISSION_WAIT, by="tenant"),
    ),
    PanelSpec(
        "Plans held for another tenant",
        "Per second, how often the scheduler held a plan back to keep slots free for another tenant that was busy a "
        "moment ago (serving/scheduler.py TenantSlots): above 0 only while one tenant fills the engine and another "
        "asks now and then. Counted per dispatch round, so one plan may count many times.",
        "short",
        (Query(_rate(m.SCHEDULER_KEPT_HELD), "held for another tenant"),),
    ),
    # Routing by the replicas' KV events (issue 45; MMRAG_KV_EVENTS_ENDPOINTS or MMRAG_RAY_KV_EVENTS): what decides
    # the routes, and whether each replica's events are routing's word now. Empty where events are off.
    PanelSpec(
        KV_EVENTS_PANEL,
        "Plans routed per second by what decided them: the replicas' own KV events, or the table learned from what "
        "was sent (a replica's events lost or not yet synced). Below: events received per second and KV blocks "
        "indexed, per replica; a replica whose events stop being routing's word shows in "
        "mmrag_kv_events_synced.",
        "short",
        (Query(f"sum by (source) (rate({m.ROUTES}_total[{WINDOW}]))", "routes by {{source}}", "A"),
         Query(f"sum by (replica) (rate({m.KV_EVENTS}_total[{WINDOW}]))", "events {{replica}}", "B"),
         Query(f"sum by (replica) ({m.KV_EVENTS_BLOCKS})", "blocks {{replica}}", "C"),
         Query(f"sum by (replica) ({m.KV_EVENTS_SYNCED})", "synced {{replica}}", "D")),
    ),
    PanelSpec(
        "vLLM prefix-cache hit rate",
        "vLLM's own count: prompt tokens (all, not just image) found in the prefix cache.",
        "percentunit",
        (Query(_ratio(m.VLLM_PREFIX_HITS, m.VLLM_PREFIX_QUERIES), "prefix-cache hits"),),
        max=1,
    ),
)


def dashboard_expressions(*, kv_events: bool = True) -> list[str]:
    """Every PromQL expression of every panel, in panel order; without the KV events panel's where a deployment
    routes without them (its series exist only where replicas publish events)."""
    return [q.expr for panel in PANELS for q in panel.queries if kv_events or panel.title != KV_EVENTS_PANEL]


def build_dashboard() -> dict:
    """The serving dashboard as Grafana JSON (a dict), built with grafana-foundation-sdk."""
    try:
        from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
    except ImportError as exc:
        raise ImportError("rendering dashboards needs grafana-foundation-sdk: pip install -e '.[dashboards]' "
                          "(make setup installs it)") from exc
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, TooltipDisplayMode
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    datasource = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
    board = (
        dashboard.Dashboard("mmrag serving")
        .uid(DASHBOARD_UID)
        .tags(["mmrag"])
        .description("Image-prefix KV reuse, feature-store hits, latency and throughput of the mmrag API.")
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
    )
    for panel in PANELS:
        ts = (
            timeseries.Panel()
            .title(panel.title)
            .description(panel.description)
            .datasource(datasource)
            .unit(panel.unit)
            .min(0)
            .span(12)
            .height(8)
            # Explicit options: left unset they render as `"options": null`.
            .legend(common.VizLegendOptions().display_mode(LegendDisplayMode.LIST)
                    .placement(LegendPlacement.BOTTOM).show_legend(True))
            .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI))
        )
        if panel.max is not None:
            ts = ts.max(panel.max)
        for q in panel.queries:
            ts = ts.with_target(
                prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(q.ref_id).datasource(datasource)
            )
        board = board.with_panel(ts)
    return json.loads(json.dumps(board.build().to_json(), default=_to_json))


def _to_json(obj: object) -> object:
    to_json = getattr(obj, "to_json", None)
    if callable(to_json):
        return to_json()
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def render_json(board: dict) -> str:
    """The committed form: sorted keys, 2-space indent, trailing newline (stable diffs)."""
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def render(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / DASHBOARD_FILE
    path.write_text(render_json(build_dashboard()))
    return [path]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serving.dashboards", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("deploy/grafana/dashboards"),
                        help="folder to write the dashboard JSON files to")
    args = parser.parse_args(argv)
    for path in render(args.out):
        print(path)


if __name__ == "__main__":
    main()
