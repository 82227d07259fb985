"""`mmrag bench --e2e`: the question set, the per-class and auto-choice reports and the targets as pure functions
over hand-built outcomes; then one real `--tiny` run, in process, that every side, class and the repeats run go
through (timings mean nothing there).

The real run is the smallest that reaches everything: 3 questions (one of each class, mmrag/bench/e2e.CLASS_CYCLE), 6
pages, 2 in flight, one answer length of 8 tokens (with a single length, the mmrag variants, the repeats run and
every target run at that length: mmrag/bench/e2e.py, "the reference length"), 9 repeated asks. It calls the command's
own function (`_bench_e2e`) in this process: `mmrag ingest` and `mmrag serve` are child processes as in a user's
run; the driver, the floor's pipeline and the llama-index pipelines run here. What a user's run starts afresh the
test takes from the session where it can, everything else as the bench does it: the session's tiny model is the
bench's --tiny model, linked where the bench looks for it; the session's `vllm serve` replica (vllm_server, the
same flags but for speed) is the bench's one replica (SessionReplica); and the three mmrag runs with the same
settings (mmrag, mmrag_split, mmrag_joint: only their requests differ) share one `mmrag serve` (ServeReuse), the
floor reading a copy of its index, so a run starts three servers where a user's starts five.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from mmrag.bench.corpus import _TOPICS, BenchCorpus, BenchPage, CorpusSpec
from mmrag.bench.e2e import (CLASS_CYCLE, CLASSES, COMPARISON, COMPOUND, FLOOR, LLAMAINDEX, MMRAG, MMRAG_JOINT,
                       ONE_PART, E2EError, E2EInputs, E2ESpec, Outcome, auto_choices, class_report, first_generated,
                       floor_batches, floor_question, make_questions, repeat_stream, repeats_summary, stand_in_reply,
                       targets)
from mmrag.core.engine import PromptPlan, SamplingSpec
from mmrag.core.keys import ImageKey, ResolutionPolicy
from rag.decompose import RuleDecomposer
from rag.plans import JOINT_PART_MIN_TOKENS
from rag.plans import relates_across

LENGTH = 8
QUESTIONS, CONCURRENCY, ASKS = 3, 2, 9
SIDES = ("mmrag", "floor", "mmrag_split", "mmrag_joint", "mmrag_model_decomposer", "llamaindex", "llamaindex_subq")
SIDE_FIELDS = ("questions", "questions_per_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s",
               "engine_queue_s", "engine_prefill_s", "engine_decode_s", "engine_requests_per_question",
               "prompt_tokens_per_question", "generation_tokens_per_question", "prefix_cache_hit_rate",
               "answers_with_citations", "asked_pages_cited", "pages_cited_per_question")
CLASS_FIELDS = ("questions", "questions_per_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s",
                "asked_pages_cited", "questions_per_s_over_llamaindex", "ttft_p50_over_llamaindex")
MMRAG_FIELDS = ("scheduler_queue_s", "decompose_requests_per_question", "decompose_generated_tokens_per_question",
                "decompose_decode_s_estimated", "answer_completions_per_question", "engine_ttft_p50_s",
                "decomposed_as_designed", "answer_modes", "stage_s")


def corpus(pages: int) -> BenchCorpus:
    """The bench corpus' pages as make_questions reads them (titles; nothing rendered)."""
    rows = [BenchPage(i, f"Figure {i + 1}: {_TOPICS[i % len(_TOPICS)]} by quarter", f"page-{i:03d}.png", "", (0,))
            for i in range(pages)]
    return BenchCorpus(Path("/nonexistent"), CorpusSpec(pages=pages), rows, [])


# --- the question set ------------------------------------------------------------------------------------------


def test_the_question_set_interleaves_the_three_classes_and_is_the_same_for_a_seed():
    qs = make_questions(corpus(48), E2ESpec(questions=32))
    kinds = [q.kind for q in qs]
    assert kinds == [CLASS_CYCLE[i % len(CLASS_CYCLE)] for i in range(32)]
    counts = {k: kinds.count(k) for k in CLASSES}
    assert counts == {COMPOUND: 12, COMPARISON: 12, ONE_PART: 8}
    assert counts[COMPARISON] >= len(qs) / 4
    # interleaved, not in blocks: every window of 3 questions holds all three classes
    assert all(set(kinds[i:i + 3]) == set(CLASSES) for i in range(0, 6))
    assert make_questions(corpus(48), E2ESpec(questions=32)) == qs
    assert [q.text for q in make_questions(corpus(48), E2ESpec(questions=32, seed=1))] != [q.text for q in qs]
    for q in qs:
        assert len(set(q.pages)) == len(q.pages)
        assert len(q.pages) == {COMPOUND: len(q.pages) if len(q.pages) in (2, 3) else -1, COMPARISON: 2,
                                ONE_PART: 1}[q.kind]
    # the smallest set that has every class: the smoke run's
    assert [q.kind for q in make_questions(corpus(6), E2ESpec(questions=QUESTIONS))] == list(CLASSES)


@pytest.mark.parametrize("pages", [6, 48])
def test_the_rules_split_compound_and_comparison_questions_into_one_sub_question_per_figure(pages):
    rules = RuleDecomposer(max_n=4)
    qs = make_questions(corpus(pages), E2ESpec(questions=64))
    forms = set()
    for q in qs:
        subs = rules.split(q.text)
        assert len(subs) == len(q.pages), (q, subs)
        for sub, page in zip(subs, q.pages):  # each sub-question names its own figure and no other, in order
            assert [int(n) - 1 for n in re.findall(r"\bFigure (\d+)\b", sub)] == [page], (q.text, sub)
        # a comparison is what auto answers over its pages seen together; the others split by their pages
        assert (relates_across(q.text) is not None) == (q.kind == COMPARISON), q.text
        if q.kind == COMPARISON:
            forms.add(q.text.split(" ")[0])
    assert forms == {"Compare", "What", "How"}  # the three forms the rules recognise, all drawn


def test_the_model_decomposer_stand_in_says_a_comparison_needs_its_pages_together():
    compound, comparison, one_part = make_questions(corpus(6), E2ESpec(questions=3))
    assert json.loads(stand_in_reply(comparison))["together"] is True
    assert "together" not in json.loads(stand_in_reply(compound))
    assert json.loads(stand_in_reply(one_part))["sub_questions"] == [one_part.text]


def test_the_repeat_stream_draws_repeats_over_the_question_set():
    spec = E2ESpec(questions=32)
    stream = repeat_stream(32, spec)
    assert len(stream) == spec.asks == 96 and all(0 <= i < 32 for i in stream)
    assert len(set(stream)) < len(stream) / 2  # Zipf: questions repeat
    assert repeat_stream(32, spec) == stream
    assert len(repeat_stream(3, E2ESpec(questions=3, repeat_asks=5))) == 5


# --- reports over hand-built outcomes ----------------------------------------------------------------------------


def outcome(kind: str, latency: float, ttft: float, **extra) -> Outcome:
    return Outcome(latency, ttft, "an answer", (0,), (0,), kind, extra)


def test_by_class_estimates_each_class_rate_from_its_latencies_and_divides_by_llamaindex():
    mmrag = [outcome(COMPOUND, 1.0, 0.1), outcome(COMPARISON, 2.0, 0.4), outcome(COMPOUND, 3.0, 0.3)]
    li = [outcome(COMPOUND, 4.0, 1.0), outcome(COMPARISON, 2.0, 0.8), outcome(COMPOUND, 4.0, 1.0)]
    report = class_report({"128": {MMRAG: mmrag, LLAMAINDEX: li}}, concurrency=2)
    compound = report["128"][MMRAG][COMPOUND]
    assert set(report["128"][MMRAG]) == {COMPOUND, COMPARISON}  # a class with no question has no row
    assert compound["questions"] == 2 and compound["latency_p50_s"] == 2.0
    assert compound["questions_per_s"] == pytest.approx(2 / ((1.0 + 3.0) / 2))  # questions / (latencies / c)
    assert compound["questions_per_s_over_llamaindex"] == pytest.approx(8 / 4)
    assert compound["ttft_p50_over_llamaindex"] == pytest.approx(0.2)
    assert report["128"][MMRAG][COMPARISON]["questions_per_s_over_llamaindex"] == 1.0
    assert report["128"][LLAMAINDEX][COMPOUND]["questions_per_s_over_llamaindex"] == 1.0


def test_auto_choices_count_each_strategy_and_rule_overall_and_per_class():
    split_why = "its {} parts found different pages: each page leads its own prompt"
    outcomes = [outcome(COMPOUND, 1, 0.1, answer_mode="split", answer_mode_reason=split_why.format(2)),
                outcome(COMPOUND, 1, 0.1, answer_mode="split", answer_mode_reason=split_why.format(3)),
                outcome(COMPARISON, 1, 0.1, answer_mode="joint",
                        answer_mode_reason="it relates items across pages ('Compare')"),
                outcome(ONE_PART, 1, 0.1, answer_mode="joint",
                        answer_mode_reason="one part over several pages: each page leads its own prompt; one page to "
                                           "show: one prompt")]
    choices = auto_choices(outcomes)
    assert choices["overall"]["modes"] == {"joint": 2, "split": 2}
    assert choices["overall"]["reasons"][split_why.format("N")] == 2  # one rule, whatever its numbers
    assert choices["by_class"][COMPOUND]["modes"] == {"split": 2}
    assert choices["by_class"][COMPARISON] == {"questions": 1, "modes": {"joint": 1},
                                               "reasons": {"it relates items across pages ('Compare')": 1}}


def test_the_repeats_summary_splits_hits_from_misses_and_says_where_a_hit_was_timed():
    hits = [outcome(ONE_PART, 0.02, 0.01, answer_cache="hit", completions=0,
                    timings={"decompose_s": 0.001, "retrieve_s": 0.009}) for _ in range(3)]
    misses = [outcome(ONE_PART, 2.0, 0.5, answer_cache="miss", completions=2, timings={"answer_s": 1.9})
              for _ in range(2)]
    s = repeats_summary(hits + misses, wall_s=2.5)
    assert (s["asks"], s["answer_cache_hits"], s["answer_cache_misses"]) == (5, 3, 2)
    assert s["answer_cache_hit_rate"] == 0.6 and s["questions_per_s"] == 2.0
    assert s["hit_latency_p50_s"] == 0.02 and s["miss_latency_p50_s"] == 2.0
    assert s["hit_p50_measured_at"] == "server" and s["hit_p50_s"] == pytest.approx(0.01)
    assert s["answer_completions_per_ask"] == 0.8  # the misses' 4 requests over 5 asks
    no_timings = repeats_summary([outcome(ONE_PART, 0.03, 0.01, answer_cache="hit", completions=0, timings={})],
                                 wall_s=1.0)
    assert no_timings["hit_p50_measured_at"] == "client (loopback)" and no_timings["hit_p50_s"] == 0.03


def side(qps: float, ttft: float, **more) -> dict:
    return {"questions_per_s": qps, "ttft_p50_s": ttft, "prefix_cache_hit_rate": 0.5,
            "generation_tokens_per_question": 128, "asked_pages_cited": 0.9, **more}


def test_targets_are_the_issues_each_measured_and_judged():
    by_length = {"4": {}, "128": {MMRAG: side(2.0, 0.1), LLAMAINDEX: side(1.0, 1.0), FLOOR: side(2.5, 0.1),
                                  MMRAG_JOINT: side(1.5, 0.1, prefix_cache_hit_rate=0.6)}}
    cls = {COMPOUND: {"questions_per_s_over_llamaindex": 2.1, "ttft_p50_over_llamaindex": 0.1},
           COMPARISON: {"questions_per_s_over_llamaindex": 1.2, "ttft_p50_over_llamaindex": 0.9},
           ONE_PART: {"questions_per_s_over_llamaindex": 1.6, "ttft_p50_over_llamaindex": 0.1}}
    by_class = {"4": {MMRAG: {**cls, ONE_PART: {"questions_per_s_over_llamaindex": 0.9}}}, "128": {MMRAG: cls}}
    repeats = {"hit_p50_s": 0.01, "hit_p50_measured_at": "server"}
    found = {t["name"]: t for t in targets(by_length, by_class, repeats, 128)}
    at = "at 128 tokens"
    met = {name: t["met"] for name, t in found.items()}
    assert met == {
        f"questions/s mmrag / llamaindex {at}": True,  # 2.0 >= 1.6
        f"questions/s mmrag / llamaindex on compound questions {at} (estimated per class)": True,
        f"questions/s mmrag / llamaindex on comparison questions {at} (estimated per class)": False,  # 1.2 < 1.3
        f"questions/s mmrag / llamaindex on one_part questions {at} (estimated per class)": True,
        "questions/s mmrag / llamaindex, lowest class at 4 tokens": False,  # one-part at 0.9
        "questions/s mmrag / llamaindex, lowest class at 128 tokens": True,
        f"TTFT p50 mmrag / llamaindex {at}": True,  # 0.1 <= 0.2
        f"TTFT p50 mmrag / llamaindex on comparison questions {at}": False,  # 0.9 > 0.8
        f"prefix-cache hit rate, mmrag_joint minus llamaindex {at}": True,
        f"questions/s mmrag / floor {at}": True,  # 0.8 >= 0.7
        f"repeated question from the answer cache, p50 s {at} (at the server)": True,
        f"generated tokens per question mmrag / llamaindex {at}": True,
        f"asked pages cited, mmrag minus llamaindex {at}": True,
    }
    assert found["questions/s mmrag / llamaindex, lowest class at 4 tokens"]["worst_class"] == ONE_PART
    assert found[f"questions/s mmrag / floor {at}"]["measured"] == 0.8
    assert all(t["wanted"].startswith((">= ", "<= ")) for t in found.values())


# --- the floor and the stream ------------------------------------------------------------------------------------


def plan(name: str, images: int = 1) -> PromptPlan:
    keys = tuple(ImageKey(hashlib.sha256(f"{name}{i}".encode()).hexdigest(), "0" * 8, ResolutionPolicy(1, 2))
                 for i in range(images))
    return PromptPlan(keys, name, sampling=SamplingSpec(max_tokens=8))


def test_the_floor_runs_a_question_s_page_plans_together_and_its_synthesis_after_them():
    a, b, synth = plan("a"), plan("b"), plan("synthesis", images=0)
    split = floor_question([a, b], (1, 2), "q")
    assert split.plans == (a, b) and split.synthesis is None and split.streamed is a
    overflow = floor_question([a, b, synth], (1, 2), "q")
    assert overflow.synthesis is synth and overflow.streamed is synth and overflow.all_plans == (a, b, synth)
    with pytest.raises(E2EError, match="submitted 1 plans with images and 1 without"):
        floor_question([synth, a], (1,), "q")  # a synthesis before the plans it reads


def test_floor_batches_count_a_plan_once_per_batch_and_keep_questions_whole():
    a, b, c, d = plan("a"), plan("b"), plan("c"), plan("d")
    costs = [[(a, 300), (b, 300)], [(a, 300)], [(c, 300), (b, 300)], [(c, 300), (d, 300)]]
    # 600 for the first question; the second's plan is cached already; the third adds c only (b is cached)
    assert floor_batches(costs, budget=900) == [[0, 1, 2], [3]]
    assert floor_batches(costs, budget=600) == [[0, 1], [2], [3]]
    assert floor_batches(costs, budget=100) == [[0], [1], [2], [3]]  # over the budget alone: a batch of its own


def test_ttft_is_the_first_generated_text_past_a_split_answers_heading():
    split = {"answer_mode": "split", "answer": "[a.png, page 1]: xy\n\n[b.png, page 1]: z",
             "image_answers": [{"page": "[a.png, page 1]", "answer": "xy"}, {"page": "[b.png, page 1]", "answer": "z"}]}
    tokens = [(1.0, "[a.png, page 1]: "), (2.0, "x"), (3.0, "y")]
    assert first_generated(tokens, split) == 2.0
    assert first_generated(tokens, {"answer_mode": "joint", "answer": "..."}) == 1.0  # one prompt: no heading
    joint = {**split, "answer_mode": "joint"}  # a joint answer in parts: the same headings
    assert first_generated(tokens, joint) == 2.0
    assert first_generated(tokens[:1], split) is None  # the heading alone: nothing generated


def test_mmrag_runs_with_only_the_bench_s_settings_and_the_answer_cache_off(monkeypatch, tmp_path):
    monkeypatch.setenv("MMRAG_REDIS_URL", "redis://elsewhere:6379/0")
    monkeypatch.setenv("MMRAG_ANSWER_MODE", "split")
    monkeypatch.setenv("MMRAG_EMULATE_ISA", "avx2")
    inputs = E2EInputs(Path("/model"), corpus(6), E2ESpec(questions=3, lengths=(8,)), _engine_config(), tmp_path,
                       print, lambda env: None)
    env = inputs.env()
    assert "MMRAG_REDIS_URL" not in env and env["MMRAG_ANSWER_MODE"] == "auto"
    assert env["MMRAG_ANSWER_CACHE"] == "false" and env["MMRAG_EMULATE_ISA"] == "avx2"


def _engine_config():
    from serving.engine.config import EngineConfig

    return EngineConfig(block_size=None, kv_cache_gib=1, max_model_len=4096, max_images_per_prompt=12,
                        enforce_eager=True, dtype="float32", max_num_seqs=8)


# --- one real run ------------------------------------------------------------------------------------------------


class SessionReplica:
    """The session's `vllm serve` replica (conftest's vllm_server) in the place of the one the bench would start:
    the same checkpoint and the engine flags the prompts and the reports depend on (what differs, the dtype, the
    batch's sequences and the processor's pixel bounds spelled out as the model's own, changes only speed), in
    dev mode (its cache resets). The session stops it, not the bench."""

    def __init__(self, url: str, model: Path, config) -> None:
        self.url, self.model, self.config = url, model, config

    def __call__(self, model_path: Path, config, log_path: Path, *, port: int) -> SessionReplica:
        from mmrag.adapters.checkpoint import checkpoint_fingerprint

        assert checkpoint_fingerprint(model_path) == checkpoint_fingerprint(self.model)
        same = ("block_size", "kv_cache_gib", "max_model_len", "max_images_per_prompt", "enforce_eager", "caching",
                "image_input", "max_num_batched_tokens")
        assert {f: getattr(config, f) for f in same} == {f: getattr(self.config, f) for f in same}
        return self

    def stop(self) -> None:
        pass


class ServeReuse:
    """`start_mmrag_serve` that keeps each `mmrag serve` running when the bench stops it, and hands it to the next
    run with the very same settings (mmrag, mmrag_split and mmrag_joint differ only in their requests): one start
    where the bench makes three. That run's replica is reset as ever, but not warmed again (the first run's start
    warmed it). Another setting stops the kept server and starts one; so does the end of the run."""

    def __init__(self, start) -> None:
        self.start = start
        self.kept: tuple[dict, object] | None = None
        self.starts = 0

    def __call__(self, env: dict[str, str], log_path: Path, timeout_s: float = 600):
        if self.kept is None or self.kept[0] != env:
            self.close()
            self.kept = (env, self.start(env, log_path, timeout_s))
            self.starts += 1
        return _Kept(self.kept[1])

    def close(self) -> None:
        if self.kept is not None:
            self.kept[1].stop()
            self.kept = None


class _Kept:
    def __init__(self, handle) -> None:
        self.url = handle.url

    def stop(self) -> None:
        pass  # ServeReuse stops it


def floor_on_a_copy(floor_pipeline):
    """The floor's pipeline over a copy of mmrag's data folder: Qdrant local mode lets one process open a folder,
    and the kept `mmrag serve` holds mmrag's."""
    import shutil

    from tests.conftest import copy_index_and_store

    def build(env: dict[str, str]):
        data = Path(env["MMRAG_DATA_DIR"])
        copy = data.with_name(f"{data.name}-floor")
        shutil.rmtree(copy, ignore_errors=True)
        copy_index_and_store(data, copy)
        return floor_pipeline({**env, "MMRAG_DATA_DIR": str(copy)})

    return build


@pytest.fixture(scope="module")
def e2e_run(tiny_model: Path, vllm_server: str, engine_settings, tmp_path_factory: pytest.TempPathFactory) -> dict:
    import mmrag.bench.e2e
    from mmrag.bench.model import TINY_SPEC
    from mmrag.core.settings import Settings
    from mmrag import bench_cmd, wiring

    data = tmp_path_factory.mktemp("bench-e2e")
    (data / "models").mkdir()
    (data / "models" / TINY_SPEC.folder_name).symlink_to(tiny_model)
    out = data / "e2e.json"
    serve = ServeReuse(mmrag.bench.e2e.start_mmrag_serve)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mmrag.bench.e2e, "start_replica", SessionReplica(vllm_server, tiny_model,
                                                              wiring.engine_config(engine_settings)))
        mp.setattr(mmrag.bench.e2e, "start_mmrag_serve", serve)
        mp.setattr(bench_cmd, "_floor_pipeline", floor_on_a_copy(bench_cmd._floor_pipeline))
        try:
            bench_cmd._bench_e2e(Settings(data_dir=data), tiny=True, depth=None, quick=False, pages=6,
                                 questions=QUESTIONS, concurrency=CONCURRENCY, max_tokens=LENGTH, zipf=1.0, seed=0,
                                 json_out=out, plot_out=data / "e2e.png")
        finally:
            serve.close()
    assert serve.starts == 3  # mmrag's settings (three runs), the model decomposer's, the repeats run's
    return {"data": json.loads(out.read_text()), "png": data / "e2e.png"}


def sides(e2e_run) -> dict[str, dict]:
    return e2e_run["data"]["e2e"]["by_length"][str(LENGTH)]


def test_every_side_reports_every_figure_with_a_streamed_ttft(e2e_run):
    e2e = e2e_run["data"]["e2e"]
    assert list(e2e["by_length"]) == [str(LENGTH)]  # --max-tokens runs that length only
    assert list(sides(e2e_run)) == list(SIDES)
    assert e2e["question_set"]["classes"] == list(CLASSES)
    for name, r in sides(e2e_run).items():
        missing = [f for f in SIDE_FIELDS if f not in r]
        assert not missing, f"{name} lacks {missing}"
        assert r["questions"] == QUESTIONS and r["questions_per_s"] > 0, name
        assert r["engine_prefill_s"] > 0 and r["prompt_tokens_per_question"] > 0, name  # the replica's counters
        # Every side streams its answer: each came with generated text the client saw.
        assert r["answers_streamed"] == QUESTIONS and 0 < r["ttft_p50_s"] <= r["latency_p50_s"], name
        assert r["answers_with_citations"] == QUESTIONS and r["sample_answer"]["answer"], name


def test_every_side_is_reported_per_class_beside_llamaindex(e2e_run):
    e2e = e2e_run["data"]["e2e"]
    by_class = e2e["by_class"][str(LENGTH)]
    assert list(by_class) == list(SIDES)
    for name, classes in by_class.items():
        assert list(classes) == list(CLASSES), name  # one question of each
        for kind, r in classes.items():
            missing = [f for f in CLASS_FIELDS if f not in r]
            assert not missing, f"{name} {kind} lacks {missing}"
            assert r["questions"] == 1
            # one question: the estimate is concurrency / its latency
            assert r["questions_per_s"] == pytest.approx(CONCURRENCY / r["latency_p50_s"], rel=1e-2), (name, kind)
            li = by_class["llamaindex"][kind]["questions_per_s"]
            assert r["questions_per_s_over_llamaindex"] == pytest.approx(r["questions_per_s"] / li, rel=1e-2,
                                                                         abs=2e-3)
    assert "sum of their latencies / concurrency" in e2e["notes"]["by_class_questions_per_s"]


def test_auto_s_choices_are_counted_and_the_variants_keep_their_strategy(e2e_run):
    r = sides(e2e_run)
    for name in ("mmrag", "mmrag_split", "mmrag_joint", "mmrag_model_decomposer"):
        missing = [f for f in MMRAG_FIELDS if f not in r[name]]
        assert not missing, f"{name} lacks {missing}"
        assert r[name]["sample_answer"]["cited_pages"], name
        assert r[name]["decomposed_as_designed"] == 1.0, name  # the rules recover every designed clause
    choices = e2e_run["data"]["e2e"]["auto_choices"][str(LENGTH)]
    assert set(choices) == {"mmrag", "mmrag_model_decomposer"}
    auto = choices["mmrag"]
    assert sum(auto["overall"]["modes"].values()) == QUESTIONS
    assert auto["overall"]["modes"] == r["mmrag"]["answer_modes"]
    assert set(auto["by_class"]) == set(CLASSES)
    # A comparison relates its pages: auto answers it over them seen together, and says why.
    assert auto["by_class"][COMPARISON]["modes"] == {"joint": 1}
    assert list(auto["by_class"][COMPARISON]["reasons"])[0].startswith("it relates items across pages")
    assert r["mmrag_joint"]["answer_modes"] == {"joint": QUESTIONS}
    assert "split" in r["mmrag_split"]["answer_modes"] and set(r["mmrag_split"]["answer_modes"]) <= {"split", "joint"}
    # Split and joint both decode exactly the answer's length (a split's parts share it), as the floor and
    # llama-index do (MMRAG_ANSWER_FIXED_LENGTH: a random model would stop at a random length).
    for name in ("mmrag", "mmrag_split", "mmrag_joint", "floor", "llamaindex"):
        assert r[name]["generation_tokens_per_question"] == LENGTH, name
    # Its requests are its answers' (the rules decompose without one): a split's part per page shown (one prompt
    # where one page is shown); a joint answer at LENGTH tokens is one prompt (a part would be shorter than
    # rag/plans.JOINT_PART_MIN_TOKENS; the parts themselves: test_pipeline, test_bench).
    assert LENGTH < 2 * JOINT_PART_MIN_TOKENS
    assert r["mmrag"]["engine_requests_per_question"] == r["mmrag"]["answer_completions_per_question"]
    assert r["mmrag_split"]["engine_requests_per_question"] > r["mmrag_joint"]["engine_requests_per_question"] == 1
    assert r["mmrag"]["stage_s"]["answer_s"] > 0 and r["mmrag"]["stage_s"]["synthesis_s"] == 0


def test_the_floor_replays_the_default_s_plans_and_the_subq_peer_sends_more(e2e_run):
    r = sides(e2e_run)
    assert r["floor"]["plans_per_question"] == r["mmrag"]["answer_completions_per_question"]
    assert r["floor"]["engine_requests_per_question"] == r["floor"]["plans_per_question"]
    assert r["floor"]["prefix_cache_hit_rate"] > 0.5  # every image prefilled before its batch ran
    assert r["llamaindex"]["engine_requests_per_question"] == 1.0  # its one-shot packs the pages into one call
    subq = r["llamaindex_subq"]
    assert subq["sub_questions_per_question"] > 1
    # One request per sub-question, and the final synthesis, each of the asked length.
    assert subq["engine_requests_per_question"] == pytest.approx(subq["sub_questions_per_question"] + 1, abs=1e-3)
    assert subq["generation_tokens_per_question"] == pytest.approx(LENGTH * subq["engine_requests_per_question"],
                                                                   abs=0.1)  # both rounded


def test_the_model_decomposer_decodes_its_stand_in_length(e2e_run):
    e2e = e2e_run["data"]["e2e"]
    rules = RuleDecomposer(max_n=4)
    chars = [len(json.dumps({"sub_questions": rules.split(q), **({"together": True} if kind == COMPARISON else {})}))
             for q, kind in zip(e2e["question_set"]["texts"], e2e["question_set"]["classes"])]
    n = e2e["decomposition"]["stand_in"]["fixed_tokens"]
    assert n == round(sum(chars) / len(chars) / 4)
    model = sides(e2e_run)["mmrag_model_decomposer"]
    # the one-part question is not sent to the model (the rules find one part); the other two are
    assert model["decompose_requests_per_question"] == pytest.approx(2 / 3, abs=1e-3)
    assert model["decompose_generated_tokens_per_question"] == pytest.approx(n * 2 / 3, abs=1e-3)
    assert model["sub_question_sources"] == {"rules": QUESTIONS}  # a random-weight reply is rejected: the rules split
    assert sides(e2e_run)["mmrag"]["decompose_requests_per_question"] == 0  # auto: the rules, no request
    assert e2e["decomposition"]["model"]["decompose_s"] > e2e["decomposition"]["rules"]["decompose_s"]


def test_repeated_questions_are_answered_from_the_answer_cache(e2e_run):
    e2e = e2e_run["data"]["e2e"]
    rep = e2e["repeats"]
    assert rep["asks"] == ASKS and rep["length"] == LENGTH and rep["settings"] == {"MMRAG_ANSWER_CACHE": "true"}
    assert rep["answer_cache_hits"] + rep["answer_cache_misses"] == ASKS
    # A question misses only while every earlier ask of it is still in flight: at most CONCURRENCY times each.
    assert rep["answer_cache_hits"] >= ASKS - CONCURRENCY * rep["distinct_questions"] > 0
    assert rep["answer_cache_hit_rate"] == round(rep["answer_cache_hits"] / ASKS, 4)
    assert rep["hit_latency_p50_s"] < rep["miss_latency_p50_s"]
    # The replica served the misses' answers and nothing else: a hit sends no engine request.
    assert rep["engine_requests_per_ask"] == rep["answer_completions_per_ask"] > 0
    assert rep["hit_p50_s"] is not None and rep["hit_p50_measured_at"] in ("server", "client (loopback)")


def test_targets_are_listed_and_printed_with_met_booleans(e2e_run):
    from mmrag.bench_cmd import _e2e_table

    e2e = e2e_run["data"]["e2e"]
    found = {t["name"]: t for t in e2e["targets"]}
    at = f"at {LENGTH} tokens"
    assert len(found) == 12
    assert f"questions/s mmrag / llamaindex {at}" in found
    per_class = {f"questions/s mmrag / llamaindex on {k} questions {at} (estimated per class)" for k in CLASSES}
    assert per_class <= set(found)
    assert f"prefix-cache hit rate, mmrag_joint minus llamaindex {at}" in found
    assert found[f"questions/s mmrag / llamaindex {at}"]["wanted"] == ">= 1.6"
    table = _e2e_table(e2e)
    for t in found.values():
        assert isinstance(t["met"], bool) and isinstance(t["measured"], float), t
        assert t["name"] in table
    assert f"### {LENGTH} answer tokens" in table and f"per class at {LENGTH} tokens" in table
    assert "| mmrag comparison |" in table and "auto chose on mmrag:" in table and "answer cache on" in table
    runs = e2e["runs_s"]  # estimated up front (and printed), then measured
    assert runs["estimated"] > 0 and runs["took"] > 0


def test_the_run_records_the_machine_and_dtype_and_plots_every_side(e2e_run):
    assert e2e_run["png"].stat().st_size > 10_000
    meta = e2e_run["data"]["meta"]
    assert meta["cpu"] and meta["dtype"] in ("float32", "bfloat16")
    assert meta["llama_index"]["llama-index-llms-openai-like"]
    assert e2e_run["data"]["e2e"]["engine"]["max_images_per_prompt"] == 12
