"""From per-request records to the JSON, the markdown tables and the plot. Pure over BenchRun."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from core.engine import Usage

from bench.runner import MIXED_SHORT_TOKENS, BenchRun, ConfigResult

# The exact layouts (prefix-cache hits only, every page seen with its siblings or said otherwise) that compete
# for "best exact layout": a config with a new pipeline layout joins here once it is in runner.CONFIGS.
EXACT_LAYOUTS = ("mmrag_warm", "mmrag_global", "mmrag_per_page")

# (name, numerator config(s), denominator config, metric, comparison, target). A tuple of numerators: the
# best of them by the metric (the one chosen is reported). The end-to-end target (questions/s of
# `mmrag serve` / llama-index over HTTP, >= 2) is not an engine configuration: the --e2e report adds it.
TARGETS = (
    ("throughput mmrag / no_cache", "mmrag", "no_cache", "throughput_qps", ">=", 3.0),
    ("throughput mmrag / apc_naive", "mmrag", "apc_naive", "throughput_qps", ">=", 1.5),
    ("throughput mmrag_warm / vllm_llamaindex", "mmrag_warm", "vllm_llamaindex", "throughput_qps", ">=", 5.0),
    ("throughput mmrag_warm / vllm_images_first", "mmrag_warm", "vllm_images_first", "throughput_qps", ">=", 3.0),
    ("TTFT p50 mmrag / no_cache", "mmrag", "no_cache", "ttft_p50_s", "<=", 0.3),
    ("TTFT p99 mmrag / apc_naive", "mmrag", "apc_naive", "ttft_p99_s", "<=", 1.0),
    ("TTFT p50 mmrag_warm / floor", "mmrag_warm", "floor", "ttft_p50_s", "<=", 1.5),
    ("hit rate best exact layout / position oracle", EXACT_LAYOUTS, None, "position_oracle_ratio", ">=", 0.9),
)

# mmrag's and mmrag_warm's ratios to what a user runs instead, and to the floor.
COMPARED = ("mmrag", "mmrag_warm")
REFERENCES = ("vllm_llamaindex", "vllm_images_first", "floor")


COLORS = {"no_cache": "#9ca3af", "vision_cache": "#6b7280", "apc_naive": "#f28e2b", "vllm_llamaindex": "#e15759",
          "vllm_images_first": "#ff9d9a", "mmrag": "#2f6db5", "mmrag_warm": "#1f4e8c", "mmrag_budget": "#59a14f",
          "mmrag_global": "#76b7b2", "mmrag_per_page": "#b07aa1",
          "floor": "#1f2a44", "mixed": "#edc948", "mixed_tiered": "#9c755f"}

# On the mixed-resolution corpus and workload, each against ``mixed``: the scheduler's short queue, and the
# pages under the standard tier's bounds and pooled 2x2.
MIXED_BASE = "mixed"
MIXED_VARIANTS = ("mixed_tiered", "mixed_standard", "mixed_pooled")


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
        "position_oracle_hit_rate": _r(r.position_oracle_hit_rate),
        "position_oracle_ratio": _r(hit / r.position_oracle_hit_rate if r.position_oracle_hit_rate else 0.0),
        "prefix_bound_hit_rate": _r(r.prefix_bound_hit_rate),
        "prefix_bound_ratio": _r(hit / r.prefix_bound_hit_rate if r.prefix_bound_hit_rate else 0.0),
        "image_hit_rate_first_image": _r(_ratio(r.first_image_tokens)),
        "image_hit_rate_later_images": _r(_ratio(r.later_image_tokens)),
        "later_image_token_share": _r(r.later_image_tokens[1] / total.image_tokens if total.image_tokens else 0.0),
        "vit_forwards_per_question": _r(r.vision_forwards / questions if questions else 0.0, 3),
        "image_prefill_share": _r((total.image_tokens - total.cached_image_tokens) / computed if computed else 0.0),
        "peak_kv_usage": _r(r.kv_usage_peak),
        "peak_kv_image_share": _r(r.kv_image_share_peak),  # estimated: serving/scheduler.KVResidency
        **_kv_estimate(r, total.image_tokens),
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
        "input": {"images": r.spec.images.value, "prompt": r.spec.prompt.value, "prefix_caching": r.spec.caching},
        **(_by_size(r) if r.spec.mixed else {}),
    }


def _kv_estimate(r: ConfigResult, image_tokens: int) -> dict[str, float]:
    """How well the KV estimate predicts residency: at each dispatch it says how many of the plan's image
    tokens lead a cached prefix; the engine then counts its own (full blocks only). As shares of all image
    tokens: the bias (predicted minus measured) and the absolute error, summed over requests."""
    diffs = [x.predicted_cached_image_tokens - x.usage.cached_image_tokens for x in r.records]
    total = image_tokens or 1  # no image tokens: no differences either
    return {"kv_estimate_bias": _r(sum(diffs) / total), "kv_estimate_abs_error": _r(sum(map(abs, diffs)) / total)}


def _by_size(r: ConfigResult) -> dict[str, Any]:
    """TTFT (scheduler queue included) of the short requests (at most MIXED_SHORT_TOKENS image tokens) and of
    the long ones, counted the same way with the short queue on or off."""
    out: dict[str, Any] = {"short_image_tokens": MIXED_SHORT_TOKENS}
    for size, records in (("short", [x for x in r.records if x.usage.image_tokens <= MIXED_SHORT_TOKENS]),
                          ("long", [x for x in r.records if x.usage.image_tokens > MIXED_SHORT_TOKENS])):
        ttft = [x.ttft_s for x in records]
        out |= {f"{size}_requests": len(records), f"{size}_ttft_p50_s": _r(_pct(ttft, 50)),
                f"{size}_ttft_p99_s": _r(_pct(ttft, 99))}
    return out


def mixed_resolution(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each variant over ``mixed`` in one run, per figure (TTFT below 1: sooner; throughput above 1: faster)."""
    base = configs.get(MIXED_BASE)
    names = ("short_ttft_p50_s", "short_ttft_p99_s", "long_ttft_p50_s", "long_ttft_p99_s", "ttft_p50_s", "ttft_p99_s",
             "throughput_qps", "peak_kv_image_share", "image_tokens")
    return {f"{v} / {MIXED_BASE}": {n: _r(configs[v][n] / base[n] if base[n] else 0.0, 3) for n in names}
            for v in MIXED_VARIANTS if base is not None and v in configs}


def targets(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, num, den, metric, op, target in TARGETS:
        nums = [n for n in ((num,) if isinstance(num, str) else num) if n in configs]
        if not nums or (den is not None and den not in configs):
            continue
        pick = max if op == ">=" else min
        best = pick(nums, key=lambda n: configs[n][metric])
        a = configs[best][metric]
        b = configs[den][metric] if den else 1.0
        value = a / b if b else float("inf")
        met = value >= target if op == ">=" else value <= target
        out[name] = {"measured": _r(value, 3), "target": f"{op} {target}", "met": bool(met), "config": best}
    return out


def layout_costs(configs: dict[str, dict[str, Any]], base: str = "mmrag_warm") -> dict[str, dict[str, Any]]:
    """What each exact layout costs and saves next to ``base`` (the canonical layout, same warm-up): engine
    requests and decode tokens (what a layout with more prompts pays), computed prompt tokens and image hit
    rate (what it saves), and which layout is best: the highest image hit rate, ties by fewer requests."""
    if base not in configs:
        return {}
    b = configs[base]
    out: dict[str, dict[str, Any]] = {}
    for name in EXACT_LAYOUTS:
        if name in configs:
            c = configs[name]
            out[name] = {
                "requests": c["requests"], "requests_ratio": _r(c["requests"] / b["requests"] if b["requests"] else 0.0, 3),
                "completion_tokens": c["completion_tokens"],
                "completion_tokens_ratio": _r(c["completion_tokens"] / b["completion_tokens"]
                                              if b["completion_tokens"] else 0.0, 3),
                "computed_prompt_tokens_ratio": _r(c["computed_prompt_tokens"] / b["computed_prompt_tokens"]
                                                   if b["computed_prompt_tokens"] else 0.0, 3),
                "image_hit_rate": c["image_hit_rate"], "position_oracle_ratio": c["position_oracle_ratio"],
            }
    if out:
        best = max(out, key=lambda n: (out[n]["image_hit_rate"], -out[n]["requests"]))
        out = {"best": best, **out}
    return out


def comparisons(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``"mmrag_warm / floor"``: throughput ratio (above 1: faster) and TTFT p50 ratio (below 1: sooner)."""
    out = {}
    for num in COMPARED:
        for den in REFERENCES:
            if num in configs and den in configs:
                a, b = configs[num], configs[den]
                out[f"{num} / {den}"] = {
                    "throughput": _r(a["throughput_qps"] / b["throughput_qps"] if b["throughput_qps"] else 0.0, 3),
                    "ttft_p50": _r(a["ttft_p50_s"] / b["ttft_p50_s"] if b["ttft_p50_s"] else 0.0, 3),
                }
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
    machine = {**run.machine, "dtype": run.dtype}
    return {"configs": configs, "comparisons": comparisons(configs), "layouts": layout_costs(configs),
            "mixed_resolution": mixed_resolution(configs), "targets": targets(configs), "model": model,
            "machine": machine, "workload": workload, "corpus": corpus, "engine": engine, "run": meta}


def markdown_tables(data: dict) -> str:
    rows = ["| config | questions/s | × no_cache | TTFT mean / p50 / p99 (s) | image hit | position oracle "
            "| hit / position oracle | prefix bound | ViT fwd / q | image prefill share | peak KV | probe TTFT (s) "
            "| other load (cores) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = data["configs"].get("no_cache", {}).get("throughput_qps") or 0.0
    for name, c in data["configs"].items():
        speedup = f"{c['throughput_qps'] / base:.2f}" if base else "–"
        rows.append(
            f"| {name} | {c['throughput_qps']:.3f} | {speedup} | {c['ttft_mean_s']:.2f} / {c['ttft_p50_s']:.2f} / "
            f"{c['ttft_p99_s']:.2f} | {c['image_hit_rate']:.3f} | {c['position_oracle_hit_rate']:.3f} | "
            f"{c['position_oracle_ratio']:.3f} "
            f"| {c['prefix_bound_hit_rate']:.3f} | {c['vit_forwards_per_question']:.2f} | "
            f"{c['image_prefill_share']:.3f} | {c['peak_kv_usage']:.3f} | {c['probe_ttft_s']:.3f} | "
            f"{c['other_cpu_cores']:.2f} |"
        )
    if data["comparisons"]:
        rows += ["", "| ratio | throughput (× faster) | TTFT p50 (× of theirs) |", "|---|---|---|"]
        rows += [f"| {name} | {c['throughput']:.2f} | {c['ttft_p50']:.2f} |" for name, c in data["comparisons"].items()]
    mixed = [(n, c) for n, c in data["configs"].items() if "short_requests" in c]
    if mixed:
        rows += ["", "| mixed resolution | short requests | short TTFT p50 / p99 (s) | long requests "
                 "| long TTFT p50 / p99 (s) | questions/s | peak KV image share (est.) | KV estimate bias / abs error |",
                 "|---|---|---|---|---|---|---|---|"]
        rows += [f"| {n} | {c['short_requests']} | {c['short_ttft_p50_s']:.2f} / {c['short_ttft_p99_s']:.2f} | "
                 f"{c['long_requests']} | {c['long_ttft_p50_s']:.2f} / {c['long_ttft_p99_s']:.2f} | "
                 f"{c['throughput_qps']:.3f} | {c['peak_kv_image_share']:.3f} | "
                 f"{c['kv_estimate_bias']:+.3f} / {c['kv_estimate_abs_error']:.3f} |" for n, c in mixed]
    m = data["machine"]
    flags = ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in m["cpu_flags"].items())
    emulated = f"; {m['emulated_isa'].upper()} emulated (kernels capped)" if m.get("emulated_isa") else ""
    rows += ["", f"{m['cpu_model']} (family/model/stepping {m['cpu_family_model_stepping']}), {m['cpus']} cores "
             f"({flags}{emulated}); dtype {m['dtype']}.", "",
             "| target | measured | wanted | met |", "|---|---|---|---|"]
    for name, t in data["targets"].items():
        chosen = "" if t["config"] in name else f" ({t['config']})"  # which one was the best of several
        rows.append(f"| {name}{chosen} | {t['measured']:.3f} | {t['target']} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(rows)


def plot(data: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(data["configs"])
    cfg = [data["configs"][n] for n in names]
    x = np.arange(len(names))
    fig = Figure(figsize=(13, 8.5), dpi=100)
    axes = fig.subplots(2, 2)
    colors = [COLORS.get(n, "#bab0ac") for n in names]

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
    ax.bar(x + w / 2, [c["position_oracle_hit_rate"] for c in cfg], w, label="position oracle", color="#d1d5db")
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
    m, wl, hw = data["model"], data["workload"], data["machine"]
    fig.suptitle(f"mmrag bench — {m['name']} ({m['params_total_m']} M params, {m['dtype']}), "
                 f"{wl['questions']} questions, {wl['arrivals']}, Zipf s={wl['zipf_s']}; {hw['cpu_model']}, "
                 f"{hw['cpus']} cores", fontsize=11)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(out))
