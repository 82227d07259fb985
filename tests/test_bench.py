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
import tempfile
from pathlib import Path

import pytest

from bench.runner import llamaindex_messages, page_caption
from bench.workload import PromptImages, WorkloadSpec, cache_tokens, make_workload, oracle_bound, prefix_bound

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {"no_cache", "vision_cache", "apc_naive", "vllm_llamaindex", "vllm_images_first", "mmrag", "mmrag_warm",
           "mmrag_budget", "mmrag_global", "mmrag_per_page", "floor", "mmrag_one_prompt", "floor_one_prompt"}
ONE_PROMPT = {"mmrag_one_prompt", "floor_one_prompt"}
PIXELS_HASHED = {"vllm_llamaindex", "vllm_images_first"}  # pixels without uuids: vLLM's content hash
CONFIG_FIELDS = {
    "throughput_qps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "image_hit_rate", "position_oracle_hit_rate",
    "position_oracle_ratio", "prefix_bound_hit_rate", "vit_forwards_per_question", "image_prefill_share",
    "peak_kv_usage", "wall_s", "peak_kv_image_share", "kv_estimate_bias", "kv_estimate_abs_error",
}


MIXED = {"mixed", "mixed_tiered", "mixed_standard", "mixed_pooled"}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One `mmrag bench --quick --tiny` run with the mixed-resolution configurations named too (--configs brings in
    what --quick leaves out): one process and one engine start for both tests below."""
    tmp_path = tmp_path_factory.mktemp("bench")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
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


def test_bench_quick_at_tiny_sizes_completes_and_its_json_has_every_field(bench_run):
    data, png, proc_stdout = bench_run["data"], bench_run["png"], bench_run["stdout"]
    assert set(data["configs"]) == CONFIGS | MIXED
    wl = data["workload"]
    for name, c in {n: c for n, c in data["configs"].items() if n in CONFIGS}.items():
        assert CONFIG_FIELDS <= set(c), (name, CONFIG_FIELDS - set(c))
        # One engine request per sub-question; per_page: one per (sub-question, distinct page); one prompt: one
        # per question. Every request decodes exactly the answer length.
        expected = wl["questions" if name in ONE_PROMPT else "page_uses" if name == "mmrag_per_page"
                      else "sub_questions_total"]
        assert c["throughput_qps"] > 0 and c["requests"] == expected, name
        assert c["requests_per_question"] == round(expected / wl["questions"], 3), name
        assert c["completion_tokens"] == expected * wl["max_tokens"] == c["answer_tokens"] * expected, name
    cfg = data["configs"]
    # One prompt shows each of a question's pages once: its image tokens are its distinct pages', not its uses.
    (per_page,) = data["model"]["image_tokens_per_page"]
    for name in ONE_PROMPT:
        assert cfg[name]["image_tokens"] == wl["question_page_uses"] * per_page < wl["page_uses"] * per_page
    # The vision encoder runs only where pixels are sent; no cache can serve the baselines.
    assert all(cfg[n]["vit_forwards_per_question"] > 0 for n in {"no_cache"} | PIXELS_HASHED)
    assert all(cfg[n]["vit_forwards_per_question"] == 0 for n in CONFIGS - {"no_cache"} - PIXELS_HASHED)
    assert cfg["no_cache"]["image_hit_rate"] == cfg["vision_cache"]["image_hit_rate"] == 0
    assert cfg["mmrag_warm"]["image_hit_rate"] > 0
    # Without uuids vLLM's own content hash keys its prefix cache: a page leading a prompt again hits, in both
    # layouts (llama-index's preamble before the first image is fixed text).
    assert all(cfg[n]["image_hit_rate"] > 0 and cfg[n]["prefix_bound_hit_rate"] > 0 for n in PIXELS_HASHED)
    # The floor prefilled every image prefix: it hits all that block granularity allows, its prefix bound, which
    # is at least the all-warm position oracle (that one stops at the block holding the last image's end).
    for floor in (cfg["floor"], cfg["floor_one_prompt"]):
        assert floor["image_hit_rate"] == floor["prefix_bound_hit_rate"] >= floor["position_oracle_hit_rate"] > 0.5
        assert floor["warm_up"]["prefixes_prefilled"] > 0
    # 8 targets with a threshold, 3 reported for one prompt; no 128-token config in --quick, so no second column.
    assert len(data["targets"]) == 11 and all("met" in t for t in data["targets"].values())
    assert [n for n, t in data["targets"].items() if t["met"] is None] == [
        "throughput mmrag_one_prompt / vllm_llamaindex", "throughput mmrag_one_prompt / vllm_images_first",
        "TTFT p50 mmrag_one_prompt / floor_one_prompt"]
    # The exact layouts' costs next to the canonical one: per_page sends one prompt per page, so more requests.
    layouts = data["layouts"]
    assert layouts["best"] in {"mmrag_warm", "mmrag_global", "mmrag_per_page"}
    assert layouts["mmrag_per_page"]["requests"] > layouts["mmrag_warm"]["requests"] == cfg["mmrag_warm"]["requests"]
    assert cfg["mmrag_global"]["requests"] == cfg["mmrag_warm"]["requests"]
    users_and_floor = ("vllm_llamaindex", "vllm_images_first", "floor")
    assert {f"{a} / {b}" for a in ("mmrag", "mmrag_warm") for b in users_and_floor} | {
        f"mmrag_one_prompt / {b}" for b in (*users_and_floor, "floor_one_prompt", "mmrag_warm")
    } == set(data["comparisons"])
    assert data["layouts"]["mmrag_one_prompt"]["requests"] < layouts["mmrag_warm"]["requests"]
    machine = data["machine"]
    assert machine["cpu_model"] != "unknown" and machine["dtype"] == data["model"]["dtype"]
    assert set(machine["cpu_flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    # This host's own kernels, unless the whole suite runs under MMRAG_EMULATE_ISA (inherited by the bench).
    assert machine["emulated_isa"] == (os.environ.get("MMRAG_EMULATE_ISA") or None)
    assert {"cold_prefill_share", "params_total_m", "dtype"} <= set(data["model"])
    assert {"questions", "pages", "zipf_s", "arrivals"} <= set(data["workload"])
    assert png.stat().st_size > 0
    assert "| mmrag_warm |" in proc_stdout and "| mmrag_one_prompt |" in proc_stdout  # the table goes to stdout


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
        assert c["short_requests"] + c["long_requests"] == c["requests"] == data["workload"]["sub_questions_total"]
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

    from bench.model import BenchModelSpec, bench_spec

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


def test_one_prompt_shows_a_questions_pages_once_most_asked_first_then_names_them_the_subs_and_the_question():
    import pytest

    from bench.corpus import BenchCorpus, BenchPage, CorpusSpec
    from bench.runner import CONFIGS as SPECS
    from bench.runner import Keys, question_plans
    from bench.workload import Question, SubQuestion
    from core.keys import ImageKey, ResolutionPolicy
    from rag.order import PagePopularity

    by_page = {i: ImageKey(f"{i + 1:064x}", "0" * 8, ResolutionPolicy(3136, 200704)) for i in range(3)}
    keys = Keys(by_page, {k: 256 for k in by_page.values()})
    pages = [BenchPage(i, f"page {i}", f"p{i}.png", f"{i + 1:064x}", (i,)) for i in range(3)]
    corpus = BenchCorpus(Path("/no-images-needed"), CorpusSpec(pages=3), pages, [])
    spec = {c.name: c for c in SPECS}
    first = Question(0, (SubQuestion("Q0.1: a?", (2,)), SubQuestion("Q0.2: b?", (1,))), 0.0)
    second = Question(1, (SubQuestion("Q1.1: c?", (0, 2)), SubQuestion("Q1.2: d?", (2, 1)),
                          SubQuestion("Q1.3: e?", (1,))), 0.0)
    popularity = PagePopularity()  # one per configuration run, as one per process
    question_plans(first, spec["mmrag_one_prompt"], keys, corpus, 128, popularity)
    (plan,) = question_plans(second, spec["mmrag_one_prompt"], keys, corpus, 128, popularity)

    # 5 page uses, 3 pages, each once. Pages 1 and 2 have been asked 3 times each, page 0 once: it goes last,
    # though it is the first sub-question's best hit.
    assert plan.images == (by_page[1], by_page[2], by_page[0])
    assert plan.text.splitlines() == [
        "Images, in the order shown:",
        "Image 1: [doc-1.pdf, page 2]", "Image 2: [doc-2.pdf, page 3]", "Image 3: [doc-0.pdf, page 1]",
        "Answer each of these sub-questions from the images, citing pages by their labels:",
        "1. Q1.1: c?", "2. Q1.2: d?", "3. Q1.3: e?",
        "Question: Q1.1: c? Q1.2: d? Q1.3: e?"]
    assert plan.sampling.max_tokens == plan.sampling.min_tokens == 128  # exactly the answer length
    per_sub = question_plans(second, spec["mmrag_warm"], keys, corpus, 128)
    assert [len(p.images) for p in per_sub] == [2, 2, 1]
    with pytest.raises(ValueError, match="PagePopularity"):
        question_plans(second, spec["floor_one_prompt"], keys, corpus, 128)


def test_the_report_states_each_ratio_and_target_at_both_answer_lengths():
    from collections import defaultdict
    from dataclasses import replace

    from bench.report import comparisons, long_answer, markdown_tables, targets
    from bench.runner import BASE_CONFIGS, CONFIGS as SPECS, LONG_ANSWER_CONFIGS, long_answer_name

    # The 128-token configurations: the named ones, otherwise the same, full run only, on the first questions.
    base = {c.name: c for c in BASE_CONFIGS}
    long = [c for c in SPECS if c.max_tokens == 128]
    assert [c.name for c in long] == [long_answer_name(n) for n in base if n in LONG_ANSWER_CONFIGS]
    for c in long:
        name = c.name.removesuffix("@128")
        assert c.full_only and c.questions
        assert replace(c, name=name, max_tokens=None, questions=None, full_only=False) == base[name]

    def summary(qps: float, ttft: float, tokens: int, questions: int) -> dict:
        return defaultdict(float, throughput_qps=qps, ttft_p50_s=ttft, answer_tokens=tokens, questions=questions)

    short = {"mmrag": 2.0, "mmrag_warm": 3.0, "mmrag_one_prompt": 4.0, "vllm_llamaindex": 1.0,
             "vllm_images_first": 1.0, "floor": 5.0, "floor_one_prompt": 8.0}
    configs = {n: summary(q, 1 / q, 4, 80) for n, q in short.items()}
    configs |= {long_answer_name(n): summary(q / 10, 2 / q, 128, 40) for n, q in short.items() if n != "mmrag"}
    configs["mmrag_warm@128"]["throughput_qps"] = 0.15  # half its short ratio to vllm_llamaindex
    data = {"configs": configs, "comparisons": comparisons(configs), "targets": targets(configs),
            "long_answer": long_answer(configs), "workload": {"max_tokens": 4},
            "machine": {"cpu_model": "cpu", "cpu_family_model_stepping": "6/1/1", "cpus": 2, "cpu_flags": {},
                        "dtype": "bfloat16"}}
    assert data["comparisons"]["mmrag_warm / vllm_llamaindex"]["throughput"] == 3.0
    assert data["comparisons"]["mmrag_warm@128 / vllm_llamaindex@128"]["throughput"] == 1.5
    assert "mmrag@128 / floor@128" not in data["comparisons"]
    t = data["targets"]
    assert t["throughput mmrag_warm / vllm_llamaindex @128"] == {
        "measured": 1.5, "target": ">= 5.0", "met": False, "config": "mmrag_warm@128", "answer_tokens": 128}
    assert t["TTFT p50 mmrag_one_prompt / floor_one_prompt @128"]["met"] is None  # reported, no threshold
    assert "hit rate best exact layout / position oracle @128" not in t  # not all exact layouts ran at 128
    assert data["long_answer"]["questions"] == 40
    table = markdown_tables(data)
    assert "| mmrag_warm / vllm_llamaindex | 3.00 | 1.50 | 0.33 | 0.33 |" in table
    assert "| mmrag / floor | 0.40 | – | 2.50 | – |" in table
    assert "128 tokens: the workload's first 40 questions." in table
    assert "| throughput mmrag_one_prompt / vllm_llamaindex @128 | 4.000 | report | – |" in table


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
    """bench.runner.llamaindex_messages against llama-index itself: RetrieverQueryEngine with multimodal=True
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
