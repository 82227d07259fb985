"""`mmrag bench`: the quick run completes at tiny sizes and reports every field; the oracle means what it says.

The benchmark itself is not a test (its numbers are in docs/benchmarks.md). The smoke run uses the tiny test
model, whose timings mean nothing; it runs in a subprocess because vLLM allows one in-process engine per
process and the session's own engine may be running in this one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mmrag.bench.runner import llamaindex_messages, page_caption
from rag.plans import JOINT_PART_MIN_TOKENS
from mmrag.bench.workload import PromptImages, WorkloadSpec, cache_tokens, make_workload, oracle_bound, prefix_bound

REPO = Path(__file__).resolve().parent.parent
PER_SUB_QUESTION = {"no_cache", "vision_cache", "apc_naive", "vllm_llamaindex", "vllm_images_first"}
STRATEGIES = {"mmrag_split": "split", "mmrag_joint": "joint", "mmrag_auto": "auto", "mmrag_split_warm": "split",
              "mmrag_joint_warm": "joint", "mmrag_auto_warm": "auto", "mmrag_auto_budget": "auto", "floor": "auto",
              "floor_split": "split", "floor_joint": "joint"}
FLOORS = {"floor", "floor_split", "floor_joint"}
CONFIGS = PER_SUB_QUESTION | set(STRATEGIES)
PIXELS_HASHED = {"vllm_llamaindex", "vllm_images_first"}  # pixels without uuids: vLLM's content hash
CONFIG_FIELDS = {
    "throughput_qps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "image_hit_rate", "position_oracle_hit_rate",
    "position_oracle_ratio", "prefix_bound_hit_rate", "vit_forwards_per_question", "image_prefill_share",
    "peak_kv_usage", "wall_s", "peak_kv_image_share", "kv_estimate_bias", "kv_estimate_abs_error", "answer_mode",
    "answer_modes",
}
ANSWER_PAGES = 4  # MMRAG_ONE_PROMPT_PAGES: the most pages an answer shows


MIXED = {"mixed", "mixed_tiered", "mixed_standard", "mixed_pooled"}


@pytest.fixture(scope="module")
def bench_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One `mmrag bench --quick --tiny` run with the full run's floors and the mixed-resolution configurations
    named too (--configs brings in what --quick leaves out): one process, its two engine starts, for the tests below.
    The session's tiny model is the bench's --tiny model, linked where the bench looks for it."""
    from mmrag.bench.model import TINY_SPEC

    tmp_path = tmp_path_factory.mktemp("bench")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    (tmp_path / "data" / "models").mkdir(parents=True)
    (tmp_path / "data" / "models" / TINY_SPEC.folder_name).symlink_to(tiny_model)
    # Its own short TMPDIR (socket paths stay under 108 bytes): what the two engine starts leave there is seen.
    with tempfile.TemporaryDirectory(prefix="mmrag-t-", dir="/tmp") as tmpdir:
        env = {**os.environ, "MMRAG_DATA_DIR": str(tmp_path / "data"), "HF_HUB_OFFLINE": "1", "TMPDIR": tmpdir}
        env.pop("VLLM_RPC_BASE_PATH", None)
        cmd = [sys.executable, "-m", "mmrag", "bench", "--quick", "--tiny", "--questions", "6", "--pages", "6",
               "--configs", ",".join(sorted(CONFIGS | MIXED)), "--json", str(out), "--plot", str(png)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        left = sorted(str(p) for p in Path(tmpdir).rglob("*") if p.is_socket() or p.name.startswith("mmrag-vllm-"))
    return {"data": json.loads(out.read_text()), "png": png, "stdout": proc.stdout, "left_in_tmp": left}


def served_answers(workload: dict) -> list[tuple[str, int]]:
    """Each question's strategy under auto and the pages it shows, from the workload alone (rag/plans.py's rules,
    restated): a question with a "Compare ..." part relates its pages (joint), the others are split; at most
    ANSWER_PAGES of its distinct pages are shown, and a split over one page is that page's one prompt."""
    spec = WorkloadSpec(**{k: workload[k] for k in ("questions", "pages", "zipf_s", "seed", "max_tokens")},
                        sub_questions=tuple(workload["sub_questions"]), pages_per_sub=tuple(workload["pages_per_sub"]))
    out = []
    for q in make_workload(spec).questions:
        shown = min(ANSWER_PAGES, len({p for s in q.subs for p in s.pages}))
        out.append(("joint" if "Compare" in q.text or shown == 1 else "split", shown))
    return out


def test_bench_quick_at_tiny_sizes_completes_and_its_json_has_every_field(bench_run):
    data, png, proc_stdout = bench_run["data"], bench_run["png"], bench_run["stdout"]
    assert set(data["configs"]) == CONFIGS | MIXED
    wl, cfg = data["workload"], data["configs"]
    answers = served_answers(wl)
    (full,), (budget,) = data["model"]["image_tokens_per_page"], data["model"]["budget_image_tokens_per_page"]
    for name, c in {n: c for n, c in cfg.items() if n in CONFIGS}.items():
        assert CONFIG_FIELDS <= set(c), (name, CONFIG_FIELDS - set(c))
        assert c["throughput_qps"] > 0 and c["questions"] == wl["questions"], name
        if name in PER_SUB_QUESTION:  # a request per sub-question over all its pages, each its answer's length
            assert c["answer_mode"] is None and c["answer_modes"] == {}, name
            assert c["requests"] == wl["sub_questions_total"], name
            assert c["completion_tokens"] == wl["sub_questions_total"] * wl["max_tokens"], name
            assert c["image_tokens"] == wl["page_uses"] * full, name
            continue
        # A strategy: a request per page shown (split: each page leading its own, unless the answer has fewer
        # tokens than pages; joint: each over every page, unless a part would be shorter than
        # JOINT_PART_MIN_TOKENS: one prompt); auto as it chose. The parts share the
        # answer's length, so every question decodes exactly one answer's length; each page of the question
        # shown once, at most ANSWER_PAGES.
        mode = STRATEGIES[name]
        modes = [m if mode == "auto" else "joint" if n == 1 else mode for m, n in answers]
        assert c["answer_mode"] == mode and c["answer_modes"] == {m: modes.count(m) for m in sorted(set(modes))}
        shortest = {"joint": JOINT_PART_MIN_TOKENS, "split": 1}
        in_parts = [1 < n and n * shortest[m] <= wl["max_tokens"] for m, (_, n) in zip(modes, answers, strict=True)]
        assert c["requests"] == sum(n if parts else 1 for parts, (_, n) in zip(in_parts, answers)), name
        assert c["completion_tokens"] == wl["questions"] * wl["max_tokens"] == c["answer_tokens"] * wl["questions"]
        per_page = budget if name == "mmrag_auto_budget" else full  # a quarter of the tokens
        # A split part shows its page; a joint answer's every part shows all its n pages.
        shown = [n * n if m == "joint" and parts else n for m, parts, (_, n) in zip(modes, in_parts, answers)]
        assert c["image_tokens"] == sum(shown) * per_page, name
        if mode == "split":
            assert c["image_tokens"] < wl["page_uses"] * per_page, name
        if mode == "split":  # one image per prompt: nothing behind a first image
            assert c["later_image_token_share"] == 0, name
    # The workload has both kinds of question, and a question with more pages than an answer shows.
    assert {m for m, _ in answers} == {"split", "joint"} and max(n for _, n in answers) == ANSWER_PAGES
    # At these few tokens a joint answer is one prompt; a split's parts are a request each.
    assert wl["max_tokens"] < 2 * JOINT_PART_MIN_TOKENS
    assert cfg["mmrag_split"]["requests"] >= cfg["mmrag_auto"]["requests"] > wl["questions"] == cfg["mmrag_joint"]["requests"]
    assert cfg["mmrag_joint_warm"]["later_image_token_share"] > 0
    # The vision encoder runs only where pixels are sent; no cache can serve the baselines.
    assert all(cfg[n]["vit_forwards_per_question"] > 0 for n in {"no_cache"} | PIXELS_HASHED)
    assert all(cfg[n]["vit_forwards_per_question"] == 0 for n in CONFIGS - {"no_cache"} - PIXELS_HASHED)
    assert cfg["no_cache"]["image_hit_rate"] == cfg["vision_cache"]["image_hit_rate"] == 0
    assert all(cfg[n]["image_hit_rate"] > 0 for n in ("mmrag_split_warm", "mmrag_joint_warm", "mmrag_auto_warm"))
    # Warm-up warms each page's lone prefix, which every split prompt starts with: split hits more than cold.
    assert cfg["mmrag_split_warm"]["image_hit_rate"] > cfg["mmrag_split"]["image_hit_rate"]
    # Without uuids vLLM's own content hash keys its prefix cache: a page leading a prompt again hits, in both
    # layouts (llama-index's preamble before the first image is fixed text).
    assert all(cfg[n]["image_hit_rate"] > 0 and cfg[n]["prefix_bound_hit_rate"] > 0 for n in PIXELS_HASHED)
    # A floor prefilled every image prefix: it hits all that block granularity allows, its prefix bound, which
    # is at least the all-warm position oracle (that one stops at the block holding the last image's end).
    for name in FLOORS:
        floor = cfg[name]
        assert floor["image_hit_rate"] == floor["prefix_bound_hit_rate"] >= floor["position_oracle_hit_rate"] > 0.5
        assert floor["warm_up"]["prefixes_prefilled"] > 0
    # 8 targets with a threshold, 2 reported against the floors of split and joint; no 128-token config in
    # --quick, so no second column.
    assert len(data["targets"]) == 10 and all("met" in t for t in data["targets"].values())
    assert [n for n, t in data["targets"].items() if t["met"] is None] == [
        "TTFT p50 mmrag_split_warm / floor_split", "TTFT p50 mmrag_joint_warm / floor_joint"]
    assert data["targets"]["hit rate best strategy / position oracle"]["config"] in {
        "mmrag_split_warm", "mmrag_joint_warm", "mmrag_auto_warm"}
    # The strategies' costs next to the default's: a split pays a request per page shown; a joint answer at these
    # few tokens is one prompt.
    strategies = data["strategies"]
    assert strategies["best"] in {"mmrag_split_warm", "mmrag_joint_warm", "mmrag_auto_warm"}
    assert strategies["mmrag_split_warm"]["requests"] >= strategies["mmrag_auto_warm"]["requests"] > wl["questions"] \
        == strategies["mmrag_joint_warm"]["requests"]
    assert strategies["mmrag_auto_warm"]["requests_ratio"] == 1.0
    users_and_floor = ("vllm_llamaindex", "vllm_images_first", "floor")
    assert {f"{a} / {b}" for a in ("mmrag_auto", "mmrag_auto_warm") for b in users_and_floor} | {
        f"{a} / {b}" for a in ("mmrag_split_warm", "mmrag_joint_warm") for b in ("vllm_llamaindex", "mmrag_auto_warm")
    } | {"mmrag_split_warm / floor_split", "mmrag_joint_warm / floor_joint"} == set(data["comparisons"])
    machine = data["machine"]
    assert machine["cpu_model"] != "unknown" and machine["dtype"] == data["model"]["dtype"]
    assert set(machine["cpu_flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    # This host's own kernels, unless the whole suite runs under MMRAG_EMULATE_ISA (inherited by the bench).
    assert machine["emulated_isa"] == (os.environ.get("MMRAG_EMULATE_ISA") or None)
    assert {"cold_prefill_share", "params_total_m", "dtype"} <= set(data["model"])
    assert {"questions", "pages", "zipf_s", "arrivals"} <= set(data["workload"])
    assert png.stat().st_size > 0
    # The table goes to stdout, with what each strategy answered.
    assert "| mmrag_auto_warm |" in proc_stdout and "| mmrag_split |" in proc_stdout
    auto = cfg["mmrag_auto"]["answer_modes"]
    assert f"mmrag_auto {auto['split']} / {auto['joint']}" in proc_stdout


def test_the_mixed_resolution_configs_run_on_pages_of_a_16x_token_spread_and_report_short_and_long_ttft(bench_run):
    data, names = bench_run["data"], MIXED
    policies = data["model"]["mixed_policies"]
    tokens = policies["full"]["image_tokens_per_page"]
    assert max(tokens) / min(tokens) >= 16
    assert max(policies["standard"]["image_tokens_per_page"]) <= 256  # the A4 page scaled to the standard tier
    assert policies["pooled"]["policy"].endswith("-pool2")
    cfg = {n: c for n, c in data["configs"].items() if n in MIXED}
    base, tiered = cfg["mixed"], cfg["mixed_tiered"]
    for c in cfg.values():
        # Per-sub-question plans on purpose (mmrag/bench/runner.py): a request per sub-question.
        assert c["short_requests"] + c["long_requests"] == c["requests"] == data["workload"]["sub_questions_total"]
        assert c["answer_mode"] is None
        assert 0 < c["peak_kv_image_share"] <= 1
        # At dispatch the KV estimate predicts the engine's own cached image tokens closely: nothing is evicted
        # at this size, so what is left is the block the last cached image shares with the text.
        assert 0 <= c["kv_estimate_abs_error"] < 0.1
    # The same plans either way, split by the same threshold: only the scheduling differs.
    assert base["short_requests"] > 0 and base["long_requests"] > 0
    assert (base["short_requests"], base["long_requests"]) == (tiered["short_requests"], tiered["long_requests"])
    assert base["scheduler"]["short_dispatched"] == 0
    assert tiered["scheduler"]["short_dispatched"] == tiered["short_requests"]
    # Pooling keeps about a quarter of the tokens (sides rounded to whole pooled tokens), and the engine took them.
    assert 0.2 < cfg["mixed_pooled"]["image_tokens"] / base["image_tokens"] < 0.3
    assert cfg["mixed_standard"]["image_tokens"] < base["image_tokens"]
    ratios = data["mixed_resolution"]
    assert set(ratios) == {f"{n} / mixed" for n in names - {"mixed"}}
    assert {"short_ttft_p50_s", "short_ttft_p99_s", "throughput_qps"} <= set(ratios["mixed_tiered / mixed"])
    assert "| mixed_tiered |" in bench_run["stdout"]


def test_two_engine_starts_and_stops_leave_no_socket_file_in_the_temp_folder(bench_run):
    # vLLM binds seven ipc:// sockets per engine start and unlinks none (serving/engine/lifeline.py): they went to
    # a folder of the bench's process, removed when it exited.
    assert bench_run["left_in_tmp"] == []


def test_the_bench_model_is_shallower_where_the_engine_runs_fp32():
    import pytest

    from mmrag.bench.model import BenchModelSpec, bench_spec

    full, fp32 = bench_spec("bfloat16"), bench_spec("float32")
    assert (full.layers, full.vision_depth) == (8, 8) and (fp32.layers, fp32.vision_depth) == (1, 1)
    same = ("hidden", "vision_embed_dim", "min_pixels", "max_pixels", "seed")
    assert all(getattr(fp32, f) == getattr(full, f) == getattr(BenchModelSpec(), f) for f in same)
    assert fp32.folder_name != full.folder_name  # its own checkpoint, and its own encoder version
    assert bench_spec("float32", depth=5).layers == bench_spec("bfloat16", depth=5).vision_depth == 5
    with pytest.raises(ValueError, match="at least 1 layer"):
        bench_spec("float32", depth=0)


def test_the_workload_is_deterministic_with_2_to_4_sub_questions_of_1_to_2_distinct_pages():
    spec = WorkloadSpec(questions=40, pages=20, seed=3)
    a, b = make_workload(spec), make_workload(spec)
    assert a.questions == b.questions
    for q in a.questions:
        assert 2 <= len(q.subs) <= 4
        assert all(1 <= len(s.pages) <= 2 and len(set(s.pages)) == len(s.pages) for s in q.subs)
    uses = a.page_uses()
    assert uses[0] > uses[19]  # Zipf: the first page is the most popular


def _bench_corpus(n: int):
    """``n`` pages, each in a document of its own, with made-up keys of 256 tokens (no images are read)."""
    from mmrag.bench.corpus import BenchCorpus, BenchPage, CorpusSpec
    from mmrag.bench.runner import Keys
    from mmrag.core.keys import ImageKey, ResolutionPolicy

    # Keys sort the other way round from the pages: a stable order by key is not the retrieval order by chance.
    by_page = {i: ImageKey(f"{n - i:064x}", "0" * 8, ResolutionPolicy(3136, 200704)) for i in range(n)}
    pages = [BenchPage(i, f"page {i}", f"p{i}.png", f"{n - i:064x}", (i,)) for i in range(n)]
    return Keys(by_page, {k: 256 for k in by_page.values()}), BenchCorpus(Path("/no-images-needed"),
                                                                         CorpusSpec(pages=n), pages, [])


async def test_each_strategy_plans_every_question_as_the_pipeline_does():
    """The bench's plans of mmrag_split, mmrag_joint and mmrag_auto are what rag/pipeline.Pipeline.ask submits for
    the same sub-questions and hits: the real pipeline, its decomposition and retrieval replaced by the bench's
    simulated ones (the only fakes: the bench has no index), its plans recorded at ``submit``."""
    from types import SimpleNamespace

    from mmrag.bench.runner import CONFIGS as SPECS
    from mmrag.bench.runner import BenchInputs, default_engine_config, question_hits, question_plans
    from mmrag.core.engine import Completion, Usage
    from rag.decompose import Decomposition
    from rag.pipeline import Pipeline

    keys, corpus = _bench_corpus(6)
    workload = make_workload(WorkloadSpec(questions=6, pages=6, max_tokens=8))
    inputs = BenchInputs(model=None, corpus=corpus, workload=workload, store=None, full=keys, budget=keys,
                         engine_config=default_engine_config())
    by_text = {q.text: q for q in workload.questions}

    class Decomposer:
        async def decompose(self, question: str) -> Decomposition:
            return Decomposition([s.text for s in by_text[question].subs], "rules", None)

    class Searcher:
        async def search_many(self, subs: list[str], **_) -> list:
            (q,) = [q for q in workload.questions if [s.text for s in q.subs] == subs]
            return question_hits(q, keys, corpus)

    submitted = []

    async def submit(plan, **_) -> Completion:
        submitted.append(plan)
        return Completion("", [], Usage(), "bench")

    spec = {c.name: c for c in SPECS}
    chosen = set()
    for name in ("mmrag_split", "mmrag_joint", "mmrag_auto"):
        config = inputs.pipeline_config(spec[name])
        pipeline = Pipeline(Decomposer(), Searcher(), SimpleNamespace(model_name="bench", random_weights=True),
                            config=config, submit=submit)
        for q in workload.questions:
            submitted.clear()
            answer = await pipeline.ask(q.text, answer_mode=spec[name].answer_mode)
            assert question_plans(q, spec[name], keys, corpus, config) == submitted, (name, q.qid)
            chosen.add((name, answer.extra["answer_mode"]))
    # Every branch ran: split and joint answers, and auto choosing each.
    assert {("mmrag_auto", "split"), ("mmrag_auto", "joint"), ("mmrag_split", "split")} <= chosen
    assert ("mmrag_joint", "split") not in chosen


def test_the_strategies_show_a_questions_pages_once_at_most_four_in_a_stable_order_or_each_leading_a_prompt():
    import pytest

    from mmrag.bench.runner import CONFIGS as SPECS
    from mmrag.bench.runner import ConfigSpec, ImageInput, question_plans
    from mmrag.bench.workload import Question, SubQuestion
    from mmrag.core.engine import Layout
    from rag.pipeline import PipelineConfig
    from rag.plans import AnswerMode
    from serving.scheduler import Policy

    keys, corpus = _bench_corpus(6)
    spec = {c.name: c for c in SPECS}
    config = PipelineConfig(max_tokens=128, max_images_per_prompt=8, fixed_length=True)
    q = Question(0, (SubQuestion("Q0.1: a?", (2, 0)), SubQuestion("Q0.2: b?", (1, 2)),
                     SubQuestion("Q0.3: c?", (5, 3))), 0.0)
    # Joint: 4 of the 5 pages (each sub-question's best first, then by rank), ordered by key, seen together by
    # a part per page: the same prompt and a line each, the parts decoding the answer's length between them.
    joint = question_plans(q, spec["mmrag_joint"], keys, corpus, config)
    shown = [keys.by_page[p] for p in (2, 1, 5, 0)]
    assert {plan.images for plan in joint} == {tuple(sorted(shown, key=str))} == {
        tuple(keys.by_page[p] for p in (5, 2, 1, 0))}
    assert [plan.text.splitlines()[:-1] for plan in joint] == [[
        "Images, in the order shown:",
        "Image 1: [doc-5.pdf, page 6]", "Image 2: [doc-2.pdf, page 3]", "Image 3: [doc-1.pdf, page 2]",
        "Image 4: [doc-0.pdf, page 1]",
        "Answer each of these sub-questions from the images, citing pages by their labels:",
        "1. Q0.1: a?", "2. Q0.2: b?", "3. Q0.3: c?",
        "Question: Q0.1: a? Q0.2: b? Q0.3: c?"]] * 4
    assert [re.search(r"Write part (\d) only", plan.text.splitlines()[-1])[1] for plan in joint] == ["1", "2", "3", "4"]
    assert [p.sampling.max_tokens for p in joint] == [p.sampling.min_tokens for p in joint] == [32] * 4
    # Split (and auto, for a question relating nothing): the same pages, each leading its own prompt with the
    # sub-questions that found it, in the answer's order; the parts decode the answer's length between them.
    for name in ("mmrag_split", "mmrag_auto", "floor_split", "floor"):
        parts = question_plans(q, spec[name], keys, corpus, config)
        assert [p.images for p in parts] == [(k,) for k in shown], name
        assert [p.sampling.max_tokens for p in parts] == [p.sampling.min_tokens for p in parts] == [32] * 4
        assert parts[0].text.splitlines()[-3:] == [  # page 2: the two sub-questions that found it
            "1. Q0.1: a?", "2. Q0.2: b?", "Question: Q0.1: a? Q0.2: b? Q0.3: c?"]
    # A question that relates its pages is joint under auto.
    compare = Question(1, (SubQuestion("Q1.1: Compare the series of churn shown here?", (2,)),
                           SubQuestion("Q1.2: What is the trend of margin shown here?", (4,))), 0.0)
    assert [len(p.images) for p in question_plans(compare, spec["mmrag_auto"], keys, corpus, config)] == [2, 2]
    assert [len(p.images) for p in question_plans(compare, spec["mmrag_split"], keys, corpus, config)] == [1, 1]
    # Per sub-question (the baselines): a plan per sub-question over all its pages, each the answer's length.
    per_sub = question_plans(q, spec["apc_naive"], keys, corpus, config)
    assert [len(p.images) for p in per_sub] == [2, 2, 2] and {p.sampling.max_tokens for p in per_sub} == {128}
    with pytest.raises(ValueError, match="layout=CANONICAL"):
        ConfigSpec("x", ImageInput.TOKENS, caching=True, policy=Policy.FCFS, layout=Layout.NAIVE,
                   answer_mode=AnswerMode.SPLIT)


def test_the_report_states_each_ratio_and_target_at_both_answer_lengths():
    from collections import defaultdict
    from dataclasses import replace

    from mmrag.bench.report import comparisons, long_answer, markdown_tables, targets
    from mmrag.bench.runner import BASE_CONFIGS, CONFIGS as SPECS, LONG_ANSWER_CONFIGS, long_answer_name

    # The 128-token configurations: the named ones, otherwise the same, full run only, on the first questions.
    base = {c.name: c for c in BASE_CONFIGS}
    long = [c for c in SPECS if c.max_tokens == 128]
    assert [c.name for c in long] == [long_answer_name(n) for n in base if n in LONG_ANSWER_CONFIGS]
    for c in long:
        name = c.name.removesuffix("@128")
        assert c.full_only and c.questions
        assert replace(c, name=name, max_tokens=None, questions=None, full_only=False) == base[name]

    def summary(qps: float, ttft: float, tokens: int, questions: int, oracle: float = 0.5) -> dict:
        return defaultdict(float, throughput_qps=qps, ttft_p50_s=ttft, answer_tokens=tokens, questions=questions,
                           position_oracle_ratio=oracle)

    short = {"mmrag_auto": 2.0, "mmrag_auto_warm": 3.0, "mmrag_split_warm": 4.0, "mmrag_joint_warm": 2.5,
             "vllm_llamaindex": 1.0, "vllm_images_first": 1.0, "floor": 5.0, "floor_split": 8.0}
    configs = {n: summary(q, 1 / q, 4, 80) for n, q in short.items()}
    configs |= {long_answer_name(n): summary(q / 10, 2 / q, 128, 40) for n, q in short.items() if n != "mmrag_auto"}
    configs["mmrag_auto_warm@128"]["throughput_qps"] = 0.15  # half its short ratio to vllm_llamaindex
    configs["mmrag_split_warm@128"]["position_oracle_ratio"] = 0.95
    configs["mmrag_auto"]["answer_modes"] = {"joint": 3, "split": 77}
    data = {"configs": configs, "comparisons": comparisons(configs), "targets": targets(configs),
            "long_answer": long_answer(configs), "workload": {"max_tokens": 4},
            "machine": {"cpu_model": "cpu", "cpu_family_model_stepping": "6/1/1", "cpus": 2, "cpu_flags": {},
                        "dtype": "bfloat16"}}
    assert data["comparisons"]["mmrag_auto_warm / vllm_llamaindex"]["throughput"] == 3.0
    assert data["comparisons"]["mmrag_auto_warm@128 / vllm_llamaindex@128"]["throughput"] == 1.5
    assert data["comparisons"]["mmrag_split_warm / mmrag_auto_warm"]["throughput"] == 1.333
    assert "mmrag_auto@128 / floor@128" not in data["comparisons"]
    assert "mmrag_joint_warm / floor_joint" not in data["comparisons"]  # no floor_joint in this run
    t = data["targets"]
    assert t["throughput mmrag_auto_warm / vllm_llamaindex @128"] == {
        "measured": 1.5, "target": ">= 5.0", "met": False, "config": "mmrag_auto_warm@128", "answer_tokens": 128}
    assert t["TTFT p50 mmrag_split_warm / floor_split @128"]["met"] is None  # reported, no threshold
    # Every strategy ran at 128 tokens: the best of them there, by its own oracle.
    assert t["hit rate best strategy / position oracle @128"] == {
        "measured": 0.95, "target": ">= 0.9", "met": True, "config": "mmrag_split_warm@128", "answer_tokens": 128}
    assert data["long_answer"]["questions"] == 40
    table = markdown_tables(data)
    assert "| mmrag_auto_warm / vllm_llamaindex | 3.00 | 1.50 | 0.33 | 0.33 |" in table
    assert "| mmrag_auto / floor | 0.40 | – | 2.50 | – |" in table
    assert "128 tokens: the workload's first 40 questions." in table
    assert "| TTFT p50 mmrag_split_warm / floor_split @128 | 2.000 | report | – |" in table
    assert "Questions answered split / joint: mmrag_auto 77 / 3." in table
    assert "| hit rate best strategy / position oracle @128 (mmrag_split_warm) | 0.950 | >= 0.9 | yes |" in table


def _prompt(keys: tuple[str, ...], text: tuple[int, ...]) -> PromptImages:
    """A 41-token system prompt, then 256-token images, then the text's tokens (ids 500+)."""
    pad, ids = 99, (*range(41), *[99] * len(keys), *text)
    spans = tuple((41 + 256 * i, 256) for i in range(len(keys)))
    return PromptImages(keys, spans, cache_tokens(ids, pad, keys, [256] * len(keys)))


def test_the_oracle_counts_repeat_uses_in_full_blocks_and_the_prefix_bound_needs_the_same_tokens_before():
    # Blocks of 32; the images span 41..297 (A first) and 297..553.
    a, a2 = _prompt(("A",), (500,)), _prompt(("A",), (501,))
    ba = _prompt(("B", "A"), (500,))
    # A repeat use hits the image up to its last full block: 288 - 41 tokens.
    assert oracle_bound([a, a], 32) == (288 - 41) / 512
    assert prefix_bound([a, a2], 32) == (288 - 41) / 512
    # The same prompt again: everything but the block holding its last token, which vLLM always computes.
    assert prefix_bound([a, a], 32) == (288 - 41) / 512
    # Behind another first page, A can hit in the oracle (from the next block boundary on) but not in a
    # prefix cache, which needs the prompt to start with the same tokens.
    assert oracle_bound([a, ba], 32) == (544 - 320) / 768
    assert prefix_bound([a, ba], 32) == 0
    # Warm pages hit from their first use; so does everything prefilled (the floor) up to the text.
    assert prefix_bound([a], 32, seen=[_prompt(("A",), (7,))]) == oracle_bound([a], 32, warm={"A"}) == (288 - 41) / 256
    fills = [_prompt(("A",), ()), _prompt(("B", "A"), ())]
    both = (247 + 256 + 247) / 768
    assert prefix_bound([a, ba], 32, seen=fills) == oracle_bound([a, ba], 32, warm={"A", "B"}) == both
    # Text after an image that two prompts share lets the block holding the image's end hit as well.
    ab, ab2 = _prompt(("A", "B"), (*range(600, 640), 1)), _prompt(("A", "B"), (*range(600, 640), 2))
    assert prefix_bound([ab, ab2], 32) == 512 / 1024


def test_the_llamaindex_prompt_is_the_one_llama_index_builds_for_image_nodes(tmp_path):
    """mmrag.bench.runner.llamaindex_messages against llama-index itself: RetrieverQueryEngine with multimodal=True
    over two retrieved page images, with and without metadata, the chat messages recorded at the LLM."""
    from PIL import Image
    from llama_index.core.llms import ChatMessage, ChatResponse, CustomLLM, LLMMetadata
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import ImageNode, NodeWithScore

    seen: list[list[ChatMessage]] = []

    class Recorder(CustomLLM):
        @property
        def metadata(self) -> LLMMetadata:  # a context window that holds both pages: one call, no refine
            return LLMMetadata(is_chat_model=True, context_window=32768, num_output=4)

        @llm_completion_callback()
        def complete(self, prompt, formatted=False, **kw):
            raise AssertionError("the multimodal path chats")

        @llm_completion_callback()
        def stream_complete(self, prompt, formatted=False, **kw):
            raise AssertionError("the multimodal path chats")

        @llm_chat_callback()
        def chat(self, messages, **kw):
            seen.append(list(messages))
            return ChatResponse(message=ChatMessage(role="assistant", content="answer"))

    paths = []
    for i in range(2):
        paths.append(tmp_path / f"page-{i}.png")
        Image.new("RGB", (32, 32), (80 * i, 0, 0)).save(paths[-1])
    for with_metadata in (True, False):
        nodes = [NodeWithScore(node=ImageNode(image_path=str(path), metadata={"file_name": f"doc-{i}.pdf",
                                                                              "page_label": i + 1}
                                              if with_metadata else {}), score=1.0 - 0.1 * i)
                 for i, path in enumerate(paths)]

        class Fixed(BaseRetriever):
            def _retrieve(self, query_bundle):
                return nodes

        seen.clear()
        RetrieverQueryEngine.from_args(retriever=Fixed(), llm=Recorder(), multimodal=True).query("What is shown?")
        assert len(seen) == 1
        got = [{"role": m.role.value,
                "content": [{"type": "text", "text": b.text} if b.block_type == "text" else {"type": b.block_type}
                            for b in m.blocks]} for m in seen[0]]
        got[0]["content"] = "".join(part["text"] for part in got[0]["content"])  # the system prompt: all text
        captions = [page_caption(f"doc-{i}.pdf", i + 1) if with_metadata else "" for i in range(2)]
        assert got == llamaindex_messages("What is shown?", captions)


def test_the_ordering_ablation_is_the_split_in_arrival_order_and_engine_batch_is_checked_before_any_work(tmp_path,
                                                                                                      monkeypatch):
    from dataclasses import replace

    import typer

    from mmrag.bench.runner import CONFIGS
    from mmrag import bench_cmd
    from serving.scheduler import Policy

    by_name = {c.name: c for c in CONFIGS}
    fcfs, split = by_name["mmrag_split_fcfs"], by_name["mmrag_split"]
    assert replace(fcfs, name=split.name, policy=split.policy, full_only=False) == split
    assert fcfs.policy is Policy.FCFS and fcfs.full_only  # named with --configs; not in --quick's set
    monkeypatch.setenv("MMRAG_DATA_DIR", str(tmp_path))
    for bad in ({"engine_batch": 0}, {"engine_batch": 8, "e2e": True}):
        with pytest.raises(typer.BadParameter, match="--engine-batch"):
            bench_cmd.bench(**bad)
    assert not (tmp_path / "bench").exists()
