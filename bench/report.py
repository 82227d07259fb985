"""From per-request records to the JSON, the markdown tables and the plot. Pure over BenchRun."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from core.engine import Usage

from bench.runner import BenchRun, ConfigResult

# (name, numerator config, denominator config, metric, comparison, target)
TARGETS = (
    ("throughput mmrag / no_cache", "mmrag", "no_cache", "throughput_qps", ">=", 3.0),
    ("throughput mmrag / apc_naive", "mmrag", "apc_naive", "throughput_qps", ">=", 1.5),
    ("hit rate mmrag_warm / oracle", "mmrag_warm", None, "oracle_ratio", ">=", 0.97),
    ("TTFT p50 mmrag / no_cache", "mmrag", "no_cache", "ttft_p50_s", "<=", 0.3),
    ("TTFT p99 mmrag / apc_naive", "mmrag", "apc_naive", "ttft_p99_s", "<=", 1.0),
)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _r(x: float, n: int = 4) -> float:
    return round(float(x), n)


def _ratio(pair: tuple[int, int]) -> float:
    return pair[0] / pair[1] if pair[1] else 0.0


def config_summary(r: ConfigResult, questions: int) -> dict[str, Any]:
    total = Usage()
    for rec in r.records:
        total.add(rec.usage)
    ttft = [rec.ttft_s for rec in r.records]
    computed = total.prompt_tokens - total.cached_tokens
    hit = total.cached_image_tokens / total.image_tokens if total.image_tokens else 0.0
    probe_ttft = [u.ttft_s for u in r.probe]
    return {
        "throughput_qps": _r(questions / r.wall_s if r.wall_s else 0.0),
        "wall_s": _r(r.wall_s, 2),
        "questions": questions,
        "requests": len(r.records),
        "ttft_mean_s": _r(statistics.fmean(ttft) if ttft else 0.0),
        "ttft_p50_s": _r(_pct(ttft, 50)),
        "ttft_p99_s": _r(_pct(ttft, 99)),
        "engine_ttft_p50_s": _r(_pct([rec.usage.ttft_s for rec in r.records], 50)),
        "question_latency_p50_s": _r(_pct(r.question_latencies_s, 50)),
        "question_latency_p99_s": _r(_pct(r.question_latencies_s, 99)),
        "image_hit_rate": _r(hit),
        "oracle_hit_rate": _r(r.oracle_hit_rate),
        "oracle_ratio": _r(hit / r.oracle_hit_rate if r.oracle_hit_rate else 0.0),
        "prefix_bound_hit_rate": _r(r.prefix_bound_hit_rate),
        "prefix_bound_ratio": _r(hit / r.prefix_bound_hit_rate if r.prefix_bound_hit_rate else 0.0),
        "image_hit_rate_first_image": _r(_ratio(r.first_image_tokens)),
        "image_hit_rate_later_images": _r(_ratio(r.later_image_tokens)),
        "later_image_token_share": _r(r.later_image_tokens[1] / total.image_tokens if total.image_tokens else 0.0),
        "vit_forwards_per_question": _r(r.vision_forwards / questions if questions else 0.0, 3),
        "image_prefill_share": _r((total.image_tokens - total.cached_image_tokens) / computed if computed else 0.0),
        "peak_kv_usage": _r(r.kv_usage_peak),
        "prompt_tokens": total.prompt_tokens,
        "cached_tokens": total.cached_tokens,
        "computed_prompt_tokens": computed,
        "image_tokens": total.image_tokens,
        "cached_image_tokens": total.cached_image_tokens,
        "completion_tokens": total.completion_tokens,
        "probe_ttft_s": _r(statistics.fmean(probe_ttft) if probe_ttft else 0.0),
        # CPU cores used, averaged over the config's wall time: by the bench (main process + engine) and by
        # everything else on the machine (other tenants: the noise), plus hypervisor steal.
        "own_cpu_cores": _r(r.own_cpu_cores, 2),
        "other_cpu_cores": _r(r.other_cpu_cores, 2),
        "steal_cores": _r(r.steal_cores, 2),
        "warm_up": r.warm,
        "scheduler": {"policy": r.spec.policy.value, "layout": r.spec.layout.value, **r.scheduler},
    }


def targets(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, num, den, metric, op, target in TARGETS:
        if num not in configs or (den is not None and den not in configs):
            continue
        a = configs[num][metric]
        b = configs[den][metric] if den else 1.0
        value = a / b if b else float("inf")
        met = value >= target if op == ">=" else value <= target
        out[name] = {"measured": _r(value, 3), "target": f"{op} {target}", "met": bool(met)}
    return out


def build_json(run: BenchRun, *, model: dict, workload: dict, corpus: dict, engine: dict, meta: dict) -> dict:
    questions = workload["questions"]
    configs = {name: config_summary(r, questions) for name, r in run.results.items()}
    probes = [u for r in run.results.values() for u in r.probe]
    shares = [u.ttft_s / u.latency_s for u in probes if u.latency_s]
    model = {
        **model,
        "dtype": run.dtype,
        # A cold single-page prompt with the workload's answer length: TTFT / latency, every probe of the run.
        "cold_prefill_share": _r(statistics.median(shares) if shares else 0.0, 3),
        "cold_prefill_share_min": _r(min(shares, default=0.0), 3),
        "cold_single_page_ttft_s": _r(statistics.median([u.ttft_s for u in probes]) if probes else 0.0),
        "vit_seconds_per_page": _r(run.vit_probe_s),
    }
    engine = {**engine, "kv_blocks": run.capacity.blocks, "kv_tokens": run.capacity.tokens,
              "engine_start_s": run.engine_start_s}
    return {"configs": configs, "targets": targets(configs), "model": model, "workload": workload,
            "corpus": corpus, "engine": engine, "run": meta}


def markdown_tables(data: dict) -> str:
    rows = ["| config | questions/s | × no_cache | TTFT mean / p50 / p99 (s) | image hit | oracle | hit / oracle "
            "| prefix bound | ViT fwd / q | image prefill share | peak KV | probe TTFT (s) | other load (cores) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = data["configs"].get("no_cache", {}).get("throughput_qps") or 0.0
    for name, c in data["configs"].items():
        speedup = f"{c['throughput_qps'] / base:.2f}" if base else "–"
        rows.append(
            f"| {name} | {c['throughput_qps']:.3f} | {speedup} | {c['ttft_mean_s']:.2f} / {c['ttft_p50_s']:.2f} / "
            f"{c['ttft_p99_s']:.2f} | {c['image_hit_rate']:.3f} | {c['oracle_hit_rate']:.3f} | {c['oracle_ratio']:.3f} "
            f"| {c['prefix_bound_hit_rate']:.3f} | {c['vit_forwards_per_question']:.2f} | "
            f"{c['image_prefill_share']:.3f} | {c['peak_kv_usage']:.3f} | {c['probe_ttft_s']:.3f} | "
            f"{c['other_cpu_cores']:.2f} |"
        )
    rows += ["", "| target | measured | wanted | met |", "|---|---|---|---|"]
    for name, t in data["targets"].items():
        rows.append(f"| {name} | {t['measured']:.3f} | {t['target']} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(rows)


def plot(data: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(data["configs"])
    cfg = [data["configs"][n] for n in names]
    x = np.arange(len(names))
    fig = Figure(figsize=(13, 8.5), dpi=100)
    axes = fig.subplots(2, 2)
    colors = ["#9ca3af", "#6b7280", "#f28e2b", "#2f6db5", "#1f4e8c", "#59a14f"][: len(names)]

    ax = axes[0][0]
    ax.bar(x, [c["throughput_qps"] for c in cfg], color=colors)
    ax.set_title("throughput (questions/s)")
    for i, c in enumerate(cfg):
        ax.annotate(f"{c['throughput_qps']:.2f}", (i, c["throughput_qps"]), ha="center", va="bottom", fontsize=8)

    ax = axes[0][1]
    w = 0.38
    ax.bar(x - w / 2, [c["ttft_p50_s"] for c in cfg], w, label="p50", color="#2f6db5")
    ax.bar(x + w / 2, [c["ttft_p99_s"] for c in cfg], w, label="p99", color="#e15759")
    ax.set_yscale("log")
    ax.set_title("TTFT per sub-question request (s, log scale; scheduler queue included)")
    ax.legend()

    ax = axes[1][0]
    ax.bar(x - w / 2, [c["image_hit_rate"] for c in cfg], w, label="measured", color="#59a14f")
    ax.bar(x + w / 2, [c["oracle_hit_rate"] for c in cfg], w, label="oracle bound", color="#d1d5db")
    ax.scatter(x + w / 2, [c["prefix_bound_hit_rate"] for c in cfg], marker="_", s=300, color="#1f2a44",
               label="prefix-cache bound", zorder=3)
    ax.set_ylim(0, 1.05)
    ax.set_title("image-prefix hit rate (tokens)")
    ax.legend(fontsize=8)

    ax = axes[1][1]
    ax.bar(x - w / 2, [c["image_prefill_share"] for c in cfg], w, label="image share of computed prefill",
           color="#b07aa1")
    ax2 = ax.twinx()
    ax2.bar(x + w / 2, [c["vit_forwards_per_question"] for c in cfg], w, label="ViT forwards / question",
            color="#76b7b2")
    ax.set_ylim(0, 1.05)
    ax.set_title("prefill mix and vision work")
    ax.legend(loc="upper right", fontsize=8)
    ax2.legend(loc="center right", fontsize=8)

    for row in axes:
        for a in row:
            a.set_xticks(x, names, rotation=20, fontsize=8)
    m, wl = data["model"], data["workload"]
    fig.suptitle(f"mmrag bench — {m['name']} ({m['params_total_m']} M params, {m['dtype']}), "
                 f"{wl['questions']} questions, {wl['arrivals']}, Zipf s={wl['zipf_s']}", fontsize=11)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(out))
