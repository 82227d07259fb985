"""`mmrag eval answers`: what answers are worth, per answer strategy (rag/evaluate_answers.py scores; parts from
mmrag/wiring/, built as `mmrag ask` builds them).

Imported by mmrag/cli.py at start-up (for the sub-command's --help): the pipeline, vLLM and Qdrant are imported
inside the command.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from mmrag.core.engine import Engine
    from mmrag.core.settings import Settings
    from rag.evaluate_answers import Asked, AnswerLabel

eval_app = typer.Typer(help="Judge the answers themselves: labelled questions through each answer strategy, "
                       "scored side by side.", no_args_is_help=True)
err = Console(stderr=True)

DEFAULT_STRATEGIES = ("auto", "split", "joint")
RANDOM_WEIGHTS_WARNING = (
    "[bold red]RANDOM WEIGHTS[/]: {model} is the tiny test model. Its answers are noise, so this run's answer "
    "scores mean nothing: it checks the mechanics only. Set MMRAG_MODEL to a real Qwen2-VL / Qwen2.5-VL / "
    "Qwen3-VL checkpoint to judge the strategies (docs/evaluating-answers.md).")


@eval_app.command("answers")
def answers_command(
    labels: Annotated[Path, typer.Option(
        help="Labelled questions, JSON lines: {\"id\", \"question\", \"kind\", \"pages\": [{\"doc\", \"page\"}], "
             "\"needs\": \"any\"|\"all\", \"answer\": \"short answer\"|null, \"answer_aliases\": [...]}. "
             "mmrag/bench/realdocs/labels.jsonl is one (its PDFs: `python -m mmrag.bench.realdocs.fetch --out DIR`).",
        exists=True, dir_okay=False, readable=True)],
    strategy: Annotated[list[str] | None, typer.Option(
        "--strategy", help="An answer strategy to score (repeatable), passed to the pipeline as the question's "
                           "answer_mode: auto, split or joint. Default: all three.")] = None,
    docs_dir: Annotated[Path | None, typer.Option(
        help="Folder of the labelled documents: ingested first, as `mmrag ingest` would (unchanged files are "
             "skipped). Without it, they must be ingested already.", exists=True, file_okay=False)] = None,
    max_tokens: Annotated[int | None, typer.Option(
        min=1, help="Answer length cap (MMRAG_ANSWER_MAX_TOKENS). Short answers score best on `exact`; leave "
                    "room for the fact on `contains`.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Ask only the first N questions (a quick look).")] = None,
    json_out: Annotated[Path | None, typer.Option(
        "--json", help="Also write the whole report to this file: scores per strategy and kind, the ids that "
                       "failed, and every answer with what it cited.")] = None,
) -> None:
    """Answer accuracy and citation accuracy per answer strategy, side by side.

    Asks each labelled question once per strategy, through the pipeline
    `mmrag ask` uses (MMRAG_ENGINE_URLS, else vLLM in this process), and
    scores, per strategy, overall and per question kind (text, figure):

      contains   the labelled answer (or an alias) appears whole in it
      exact      the answer is the labelled answer and nothing more
      citations  it cites a labelled page (needs=all: every one)

    Text is compared after normalising case, accents, quotes and dashes.
    Questions labelled "answer": null count for citations only.

    With the tiny random-weight model (no MMRAG_MODEL) this checks the
    mechanics only: the answers are noise. With a real Qwen2-VL, Qwen2.5-VL
    or Qwen3-VL checkpoint (a GPU host) it judges the default strategy;
    see docs/evaluating-answers.md:

      python -m mmrag.bench.realdocs.fetch --out realdocs
      MMRAG_MODEL=/models/Qwen2.5-VL-7B-Instruct mmrag eval answers \\
        --labels mmrag/bench/realdocs/labels.jsonl --docs-dir realdocs \\
        --json answers.json
    """
    from mmrag.core.settings import Settings

    strategies = list(dict.fromkeys(strategy or DEFAULT_STRATEGIES))
    settings = eval_settings(Settings(), max_tokens)
    labelled = prepare(settings, labels, strategies, docs_dir=docs_dir, limit=limit, console=err)
    out = asyncio.run(answer_report(settings, labelled, strategies, labels, err))
    if json_out is not None:
        json_out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        err.print(f"report written to {json_out}")


def prepare(settings: Settings, labels: Path, strategies: list[str], *, docs_dir: Path | None, limit: int | None,
            console: Console) -> list[AnswerLabel]:
    """Everything that can fail before an engine starts: the strategies, the labels (the first ``limit``), the
    documents ingested (``docs_dir``, as `mmrag retrieval eval` does) and every labelled page in the index."""
    from rag.evaluate_answers import load_answer_labels
    from retrieval.evaluate import LabelsError

    check_strategies(strategies)
    try:
        labelled = load_answer_labels(labels)
    except LabelsError as exc:
        raise typer.BadParameter(str(exc), param_hint="--labels") from None
    labelled = labelled[:limit] if limit else labelled
    if docs_dir is not None:
        from mmrag.retrieval_cmd import ingest_for_eval

        ingest_for_eval(settings, docs_dir, console)
    missing = unindexed_pages(settings, labelled)
    if missing:
        raise typer.BadParameter(
            f"{len(missing)} labelled pages are not indexed (e.g. {', '.join(missing[:5])}): pass the labelled "
            "documents' folder with --docs-dir (or run `mmrag ingest DIR` first), or fix the labels' doc names and "
            "page numbers")
    return labelled


async def answer_report(settings: Settings, labelled: list[AnswerLabel], strategies: list[str], labels: Path,
                        console: Console, *, engine: Engine | None = None) -> dict[str, Any]:
    """Asks, scores and prints; returns the report (rag/evaluate_answers.py ``report``, with the model, labels
    file and answer length). ``engine``: one already running (tests share theirs), else built as `mmrag ask`
    builds it and closed at the end."""
    from mmrag import wiring
    from rag.evaluate_answers import report

    model = wiring.resolve_model(settings)
    console.print(f"model: {escape(model.describe())}")
    if model.random_weights:
        console.print(RANDOM_WEIGHTS_WARNING.format(model=escape(model.name)))
    console.print(f"asking {len(labelled)} questions x {len(strategies)} strategies ({', '.join(strategies)}), "
                  f"answers up to {settings.answer.max_tokens} tokens")
    asked = await ask_every(settings, engine or wiring.engine(settings, model), labelled, strategies, console,
                            close=engine is None)
    out = {"model": {"name": model.name, "random_weights": model.random_weights}, "labels": str(labels),
           "max_tokens": settings.answer.max_tokens, **report(labelled, strategies, asked)}
    print_report(out, console)
    return out


def check_strategies(names: list[str]) -> None:
    """``--strategy`` values as given, each one an AnswerMode (old names too, with their deprecation line); a
    BadParameter naming the choices otherwise."""
    from rag.plans import AnswerMode

    for name in names:
        try:
            AnswerMode(name)
        except ValueError:
            raise typer.BadParameter(f"{name!r} is not an answer strategy; use one of "
                                     f"{', '.join(m.value for m in AnswerMode)}", param_hint="--strategy") from None


def eval_settings(settings: Settings, max_tokens: int | None) -> Settings:
    """The settings answers are asked under: ``--max-tokens``, and no answer cache, so every strategy's answer is
    generated now, by the configured model, not served from an earlier run."""
    update: dict[str, Any] = {"answer_max_tokens": max_tokens} if max_tokens else {}
    return settings.replace(answer_cache=False, **update)


def unindexed_pages(settings: Settings, labelled: list[AnswerLabel]) -> list[str]:
    """"doc:page" of each labelled page that is not in the index (all of them when nothing is ingested)."""
    from mmrag.adapters.qdrant import PAGES_ONLY
    from mmrag.core.payload import PageField
    from mmrag import wiring
    from retrieval.evaluate import unknown_docs

    index = wiring.read_index(settings)
    try:
        indexed: dict[str, int] = {}
        if index.client.collection_exists(index.collection):
            # Pages only: figure points carry their page's payload and are not pages to count.
            facet = index.client.facet(index.collection, key=PageField.DOC.value, facet_filter=PAGES_ONLY,
                                       limit=100_000, exact=True)
            indexed = {str(h.value): h.count for h in facet.hits}
    finally:
        index.client.close()
    return unknown_docs([q.labelled for q in labelled], indexed)


async def ask_every(settings: Settings, engine: Engine, labelled: list[AnswerLabel], strategies: list[str],
                    console: Console, *, close: bool) -> list[Asked]:
    """Every question through every strategy on one pipeline over ``engine`` (closed at the end if ``close``),
    built as `mmrag ask` builds it; one progress line per question."""
    from mmrag import wiring
    from rag.evaluate_answers import ask_all

    try:
        pipeline, _ = wiring.pipeline(settings, engine)
        row: list[str] = []

        def progress(i: int, asked: Asked) -> None:
            g = asked.graded
            mark = ("exact" if g.exact else "contains" if g.contains else "wrong") if g.answerable else "-"
            row.append(f"{asked.strategy}: answer {mark}, page {'cited' if g.cited else 'not cited'}")
            if len(row) == len(strategies):
                console.print(escape(f"[{i + 1}/{len(labelled)}] {asked.id}: " + "; ".join(row)))
                row.clear()

        try:
            return await ask_all(labelled, strategies,
                                 lambda question, strategy: pipeline.ask(question, answer_mode=strategy),
                                 on_asked=progress)
        finally:
            await pipeline.searcher.client.close()
    finally:
        if close:
            await engine.close()


def print_report(report: dict[str, Any], console: Console) -> None:
    """The strategies side by side: a column each, a row per score (overall, then per question kind)."""
    per = report["strategies"]
    table = Table(title=f"answer eval: {report['questions']} questions ({report['with_answer']} with a short "
                        f"answer), {report['model']['name']}")
    table.add_column("score")
    for s in per:
        table.add_column(s, justify="right")

    def row(label: str, cell) -> None:
        table.add_row(label, *(cell(r) for r in per.values()))

    for scope, pick in [("all", lambda r: r["overall"])] + [
            (kind, lambda r, k=kind: r["by_kind"].get(k)) for kind in sorted({k for r in per.values()
                                                                                for k in r["by_kind"]})]:
        for metric, n_key in (("contains", "n_answer"), ("exact", "n_answer"), ("citations", "n")):
            row(f"{scope}: {metric}", lambda r: "-" if not pick(r) or not pick(r)[n_key] else
                f"{pick(r)[metric]:.3f} of {pick(r)[n_key]}")
    row("mode chosen", lambda r: ", ".join(f"{m} {c}" for m, c in r["chosen"].items()))
    row("prompt tokens / question", lambda r: f"{r['prompt_tokens']:.0f}")
    row("answer tokens / question", lambda r: f"{r['completion_tokens']:.0f}")
    console.print(table)
    for h in report["head_to_head"]:
        console.print(f"contains, {h['first']} vs {h['second']}: only {h['first']} right on {h['only_first']}, "
                      f"only {h['second']} on {h['only_second']}, the same on {h['same']}")
    for s, r in per.items():
        failed = r["failed"]
        if failed["answer"] or failed["citations"]:
            console.print(escape(f"{s}: wrong answer: {', '.join(failed['answer']) or 'none'}; page not cited: "
                                 f"{', '.join(failed['citations']) or 'none'}"))
    if report["model"]["random_weights"]:
        console.print(RANDOM_WEIGHTS_WARNING.format(model=escape(report["model"]["name"])))
