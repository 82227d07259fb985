"""`mmrag eval answers`: answers scored on their text (contains, exact) and their citations, per strategy.

The scoring is pure and is tested on hand-made answers. One test runs the command's own functions on the tiny
random-weight model over the sample corpus, sharing the session's in-process engine: its answers are noise, so it
checks the mechanics (every question through every strategy, the strategy reaching the pipeline, each answer graded
as recorded), not the scores.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mmrag.core.engine import Usage
from rag.answer import Answer, Citation
from rag.evaluate_answers import (AnswerLabel, grade, load_answer_labels, normalise, occurs, report, score,
                                  summarise)
from retrieval.evaluate import LabelledQuestion, LabelsError, load_labels

REPO = Path(__file__).resolve().parents[1]
REALDOCS = REPO / "mmrag" / "bench" / "realdocs" / "labels.jsonl"


def label(answer: str | None, *aliases: str, pages=(("a.pdf", 1),), needs_all: bool = False, kind: str = "text",
          id: str = "q") -> AnswerLabel:
    return AnswerLabel(LabelledQuestion(f"question {id}?", frozenset(pages), needs_all, kind, id), answer, aliases)


def answer(text: str, *cited: tuple[str, int], mode: str = "joint") -> Answer:
    return Answer(text, [], [Citation(f"{d}-{p}", d, p, 1.0) for d, p in cited], Usage(prompt_tokens=100,
                  completion_tokens=10), "hand-made", False, extra={"answer_mode": mode})


# --- normalising and matching ------------------------------------------------------------------------------


def test_normalising_forgives_case_accents_typography_and_end_punctuation_but_keeps_a_facts_own_marks():
    assert normalise("  The `HC3`  estimator.\n") == "the hc3 estimator"
    assert normalise("Bézier “curves”") == "bezier curves"
    assert normalise("Don’t do something") == "don't do something"
    assert normalise("V−E+F=2") == "v-e+f=2"  # the PDF's minus sign is the model's hyphen
    assert normalise("%j") == "%j" and normalise("^W") == "^w" and normalise("C++") == "c++"
    assert normalise("a!") == "a!"  # a factorial keeps its mark


def test_contains_needs_the_label_whole_where_it_starts_or_ends_with_a_letter_or_digit():
    assert occurs("3", "use set border 3 for left and bottom")
    assert not occurs("3", "set border 31") and not occurs("3", "set border 13")
    assert not occurs("spline", "csplines") and not occurs("index_max", "stats_index_max")
    assert not occurs("hc3", "hc30 is not it")
    assert not occurs("-v", "asy -view opens it")
    assert occurs("-v", "run asy -v test")
    assert occurs("%j", "the code %j, day of the year")
    assert occurs("c++", "manet is written in c++.")
    assert not occurs("", "anything")


def test_contains_accepts_a_verbose_answer_exact_only_the_fact():
    q = label("HC3")
    verbose, bare, wrong = (grade(q, text, []) for text in ("The default type is HC3.", " `HC3`. ", "HC4"))
    assert (verbose.contains, verbose.exact) == (True, False)
    assert (bare.contains, bare.exact) == (True, True)
    assert (wrong.contains, wrong.exact) == (False, False)


def test_an_alias_counts_like_the_answer():
    q = label("640x480", "640 x 480")
    assert grade(q, "It defaults to 640 x 480 pixels", []).contains
    assert grade(q, "640 x 480", []).exact
    assert not grade(q, "640 by 480", []).contains


def test_a_question_without_a_short_answer_counts_for_citations_only():
    q = label(None, pages=(("a.pdf", 2),))
    g = grade(q, "anything at all", [("a.pdf", 2)])
    assert (g.answerable, g.contains, g.exact, g.cited) == (False, False, False, True)
    s = score([g, grade(label("red", id="r"), "red", [])])
    assert s == {"contains": 1.0, "exact": 1.0, "citations": 0.5, "n": 2, "n_answer": 1}
    assert summarise([g])["failed"] == {"answer": [], "citations": []}


def test_citations_need_any_labelled_page_or_every_one():
    pages = (("a.pdf", 1), ("b.pdf", 7))
    anyq, allq = label("x", pages=pages), label("x", pages=pages, needs_all=True)
    assert grade(anyq, "", [("b.pdf", 7)]).cited
    assert not grade(allq, "", [("b.pdf", 7), ("a.pdf", 2)]).cited
    assert grade(allq, "", [("c.pdf", 1), ("b.pdf", 7), ("a.pdf", 1)]).cited  # extra pages do not hurt
    assert not grade(anyq, "", [("a.pdf", 7)]).cited  # the page of another document is another page


async def test_every_strategy_is_scored_overall_and_per_kind_with_the_questions_it_failed():
    from rag.evaluate_answers import ask_all

    labels = [label("qnorm", id="t1", kind="text", pages=(("g.pdf", 146),)),
              label("royalblue4", id="f1", kind="figure", pages=(("v.pdf", 24),)),
              label(None, id="f2", kind="figure", pages=(("v.pdf", 45), ("v.pdf", 46)), needs_all=True)]
    by = {  # (id, strategy) -> the answer that strategy gave
        ("t1", "split"): answer("The default is qnorm.", ("g.pdf", 146), mode="split"),
        ("f1", "split"): answer("blue", ("v.pdf", 24), mode="split"),
        ("f2", "split"): answer("a mosaic", ("v.pdf", 45), mode="split"),
        ("t1", "joint"): answer("qnorm", ("g.pdf", 1)),
        ("f1", "joint"): answer("royalblue4 and mediumorchid4", ("v.pdf", 24)),
        ("f2", "joint"): answer("a mosaic", ("v.pdf", 46), ("v.pdf", 45)),
    }
    ids = {f"question {q.labelled.id}?": q.labelled.id for q in labels}

    async def ask(question: str, strategy: str) -> Answer:
        return by[ids[question], strategy]

    seen: list[tuple[int, str, str]] = []
    asked = await ask_all(labels, ["split", "joint"], ask, on_asked=lambda i, a: seen.append((i, a.id, a.strategy)))
    assert seen == [(0, "t1", "split"), (0, "t1", "joint"), (1, "f1", "split"), (1, "f1", "joint"),
                    (2, "f2", "split"), (2, "f2", "joint")]
    out = report(labels, ["split", "joint"], asked)
    split, joint = out["strategies"]["split"], out["strategies"]["joint"]
    assert out["questions"] == 3 and out["with_answer"] == 2
    assert split["overall"] == {"contains": 0.5, "exact": 0.0, "citations": 2 / 3, "n": 3, "n_answer": 2}
    assert joint["overall"] == {"contains": 1.0, "exact": 0.5, "citations": 2 / 3, "n": 3, "n_answer": 2}
    assert split["by_kind"]["figure"] == {"contains": 0.0, "exact": 0.0, "citations": 0.5, "n": 2, "n_answer": 1}
    assert joint["by_kind"]["text"] == {"contains": 1.0, "exact": 1.0, "citations": 0.0, "n": 1, "n_answer": 1}
    assert split["failed"] == {"answer": ["f1"], "citations": ["f2"]}
    assert joint["failed"] == {"answer": [], "citations": ["t1"]}
    assert split["chosen"] == {"split": 3} and joint["chosen"] == {"joint": 3}
    assert split["prompt_tokens"] == 100 and split["completion_tokens"] == 10
    assert out["head_to_head"] == [{"first": "split", "second": "joint", "only_first": 0, "only_second": 1,
                                    "same": 1}]  # f1: joint alone right; t1: both; f2 has no short answer
    first = out["answers"][0]
    assert first["id"] == "t1" and first["strategy"] == "split" and first["pages_cited"] == ["g.pdf:146"]
    assert first["contains"] and not first["exact"] and first["answerable"] and first["cited"]
    json.dumps(out)  # the --json report


# --- the labels ----------------------------------------------------------------------------------------------


def test_labels_carry_answers_beside_the_retrieval_fields_and_bad_ones_name_their_line(tmp_path):
    path = tmp_path / "labels.jsonl"
    rows = [{"id": "a", "question": "Q1?", "pages": [{"doc": "d.pdf", "page": 2}], "answer": "HC3",
             "answer_aliases": ["type HC3"], "note": "ignored"},
            {"id": "b", "question": "Q2?", "pages": [{"doc": "d.pdf", "page": 3}], "needs": "any", "answer": None},
            {"id": "c", "question": "Q3?", "pages": [{"doc": "d.pdf", "page": 4}]}]
    path.write_text("\n".join(map(json.dumps, rows)) + "\n\n")
    a, b, c = load_answer_labels(path)
    assert (a.labelled.id, a.answer, a.aliases, a.forms) == ("a", "HC3", ("type HC3",), ("hc3", "type hc3"))
    assert (b.answer, b.forms) == (None, ()) and c.answer is None
    for bad, line in (({"answer": ""}, 1), ({"answer": 3}, 1), ({"answer_aliases": "HC3"}, 1),
                      ({"answer": None, "answer_aliases": ["x"]}, 1)):
        path.write_text("\n".join(json.dumps({**rows[0], **bad}) if i == 0 else json.dumps(r)
                                  for i, r in enumerate(rows)))
        with pytest.raises(LabelsError, match=f"line {line}: `answer` must be"):
            load_answer_labels(path)


def test_the_realdocs_labels_answer_most_questions_and_no_question_gives_its_answer_away():
    labels = load_answer_labels(REALDOCS)
    assert len(labels) == len(load_labels(REALDOCS)) == 86  # the retrieval evaluator reads the same file
    answered = [q for q in labels if q.forms]
    assert len(answered) == 80
    given_away = [q.labelled.id for q in answered if any(occurs(f, normalise(q.labelled.question)) for f in q.forms)]
    assert given_away == []
    assert len({q.labelled.id for q in labels}) == 86


# --- the command -----------------------------------------------------------------------------------------------


def test_the_command_refuses_an_unknown_strategy_and_unindexed_pages_before_starting_an_engine(tmp_path):
    from mmrag.cli import app

    path = tmp_path / "labels.jsonl"
    path.write_text(json.dumps({"question": "Q?", "pages": [{"doc": "absent.pdf", "page": 3}], "answer": "x"}) + "\n")
    env = {"MMRAG_DATA_DIR": str(tmp_path / "data"), "HF_HUB_OFFLINE": "1"}
    result = CliRunner().invoke(app, ["eval", "answers", "--labels", str(path), "--strategy", "fastest"], env=env)
    assert result.exit_code == 2 and "'fastest' is not an answer strategy" in result.output
    assert "auto, split, joint" in result.output
    result = CliRunner().invoke(app, ["eval", "answers", "--labels", str(path)], env=env)
    assert result.exit_code == 2 and "absent.pdf:3" in result.output and "--docs-dir" in result.output


async def test_the_command_asks_every_question_through_every_strategy_on_the_tiny_model(
        engine_settings, ingested, inprocess_engine, sample_corpus, tmp_path):
    from mmrag.devkit.corpus import CorpusManifest
    from mmrag.eval_cmd import answer_report, eval_settings, prepare
    from tests.conftest import copy_corpus

    data = tmp_path / "data"
    copy_corpus(engine_settings, data)  # Qdrant local mode: one client per folder, and other tests read the original
    settings = eval_settings(engine_settings.replace(**{"data_dir": data}), 6)
    questions = CorpusManifest.load(sample_corpus / "manifest.json").questions[:3]
    rows = [{"id": f"s{i}", "question": q.question, "kind": "figure" if i else "text",
             "pages": [{"doc": a.file, "page": a.page} for a in q.answers], "needs": "any",
             "answer": q.fact if i else None} for i, q in enumerate(questions)]
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(json.dumps(r) + "\n" for r in rows))
    strategies = ["auto", "split", "joint"]
    shown = io.StringIO()
    console = Console(file=shown, width=200)

    labelled = prepare(settings, labels, strategies, docs_dir=None, limit=2, console=console)
    out = await answer_report(settings, labelled, strategies, labels, console, engine=inprocess_engine)

    assert out["model"]["random_weights"] and out["max_tokens"] == 6 and out["questions"] == 2
    assert [(a["id"], a["strategy"]) for a in out["answers"]] == [(f"s{i}", s) for i in range(2) for s in strategies]
    by_id = {q.labelled.id: q for q in labelled}
    for a in out["answers"]:
        q = by_id[a["id"]]
        # Graded as recorded: the flags follow from the recorded text and citations by the pure scorer.
        again = grade(q, a["answer"], [(d, int(p)) for d, _, p in (c.rpartition(":") for c in a["pages_cited"])])
        assert (a["contains"], a["exact"], a["cited"], a["answerable"]) == (
            again.contains, again.exact, again.cited, again.answerable)
        assert a["pages_cited"] and a["prompt_tokens"] > 0  # answered over retrieved pages
    modes = {s: {a["answer_mode"] for a in out["answers"] if a["strategy"] == s} for s in strategies}
    assert modes["split"] == {"split"} and modes["joint"] == {"joint"} and modes["auto"] <= {"split", "joint"}
    for s in strategies:
        r = out["strategies"][s]
        assert r["overall"]["n"] == 2 and r["overall"]["n_answer"] == 1
        assert set(r["by_kind"]) == {"text", "figure"} and sum(r["chosen"].values()) == 2
    text = shown.getvalue()
    assert "RANDOM WEIGHTS" in text and "[1/2] s0: auto:" in text and "[2/2] s1:" in text
    assert "answer eval: 2 questions (1 with a short answer)" in text and "contains, auto vs split: only" in text
    assert [(h["first"], h["second"]) for h in out["head_to_head"]] == [("auto", "split"), ("auto", "joint"),
                                                                        ("split", "joint")]
