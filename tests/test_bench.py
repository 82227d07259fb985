"""`mmrag bench`: the quick run completes at tiny sizes and reports every field; the oracle means what it says.

The benchmark itself is not a test (its numbers are in BENCHMARKS.md). The smoke run uses the tiny test
model, whose timings mean nothing; it runs in a subprocess because vLLM allows one in-process engine per
process and the session's own engine may be running in this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.workload import PromptImages, WorkloadSpec, make_workload, oracle_bound, prefix_bound

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {"no_cache", "vision_cache", "apc_naive", "mmrag", "mmrag_warm", "mmrag_budget"}
CONFIG_FIELDS = {
    "throughput_qps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "image_hit_rate", "oracle_hit_rate", "oracle_ratio",
    "prefix_bound_hit_rate", "vit_forwards_per_question", "image_prefill_share", "peak_kv_usage", "wall_s",
}


def test_bench_quick_at_tiny_sizes_completes_and_its_json_has_every_field(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    env = {**os.environ, "MMRAG_DATA_DIR": str(tmp_path / "data"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "mmrag", "bench", "--quick", "--tiny", "--questions", "6", "--pages", "6",
           "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    data = json.loads(out.read_text())
    assert set(data["configs"]) == CONFIGS
    for name, c in data["configs"].items():
        assert CONFIG_FIELDS <= set(c), (name, CONFIG_FIELDS - set(c))
        assert c["throughput_qps"] > 0 and c["requests"] == data["workload"]["sub_questions_total"]
    cfg = data["configs"]
    # The vision encoder runs per image only where pixels are sent; no cache can serve the baselines.
    assert cfg["no_cache"]["vit_forwards_per_question"] > 0
    assert all(cfg[n]["vit_forwards_per_question"] == 0 for n in CONFIGS - {"no_cache"})
    assert cfg["no_cache"]["image_hit_rate"] == cfg["vision_cache"]["image_hit_rate"] == 0
    assert cfg["mmrag_warm"]["image_hit_rate"] > 0
    assert len(data["targets"]) == 5
    assert {"cold_prefill_share", "params_total_m", "dtype"} <= set(data["model"])
    assert {"questions", "pages", "zipf_s", "arrivals"} <= set(data["workload"])
    assert png.stat().st_size > 0
    assert "| mmrag_warm |" in proc.stdout  # the table goes to stdout


def test_the_workload_is_deterministic_with_2_to_4_sub_questions_of_1_to_2_distinct_pages():
    spec = WorkloadSpec(questions=40, pages=20, seed=3)
    a, b = make_workload(spec), make_workload(spec)
    assert a.questions == b.questions
    for q in a.questions:
        assert 2 <= len(q.subs) <= 4
        assert all(1 <= len(s.pages) <= 2 and len(set(s.pages)) == len(s.pages) for s in q.subs)
    uses = a.page_uses()
    assert uses[0] > uses[19]  # Zipf: the first page is the most popular


def test_the_oracle_counts_repeat_uses_in_full_blocks_and_the_prefix_bound_needs_the_whole_prefix():
    # A 40-token system prompt, then 256-token images; blocks of 32.
    a = PromptImages(("A",), ((41, 256),))
    ba = PromptImages(("B", "A"), ((41, 256), (299, 256)))
    # A repeat use hits the image up to its last full block: 288 - 41 tokens.
    assert oracle_bound([a, a], 32) == (288 - 41) / 512
    # Behind another first page, A can hit in the oracle (from the next block boundary on) but not in a
    # prefix cache, which needs the prompt to start with the same pages.
    assert oracle_bound([a, ba], 32) == (544 - 320) / 768
    assert prefix_bound([a, ba], 32) == 0
    # Warm pages hit from their first use.
    assert prefix_bound([a], 32, warm={"A"}) == oracle_bound([a], 32, warm={"A"}) == (288 - 41) / 256
