"""What answers are worth: labelled questions asked through each answer strategy, scored on the answer's text and on
its citations, side by side (`mmrag eval answers`; docs/evaluating-answers.md).

A labels file is retrieval/evaluate.py's (question, pages, needs, kind, id) plus a short ``answer`` read from the
labelled pages and, optionally, ``answer_aliases`` (equivalent forms). ``"answer": null`` (or no answer) marks a
question whose answer is not a few words: it counts for citations only.

Three scores per strategy, overall and per question kind:

- ``contains``: the normalised labelled answer (or an alias) occurs in the normalised answer, whole: where the label
  starts or ends with a letter or digit, the answer's neighbouring character is no letter, digit or underscore,
  so "3" is not found in "31" nor "-V" in "-View". A verbose correct answer passes: the share of answers that
  carry the fact.
- ``exact``: the normalised answer equals the label or an alias: an answer that is only the fact.
- ``citations``: the answer cites the labelled page (``needs: any``: any of them; ``all``: every one).

Normalising (:func:`normalise`) forgives what a model writes around a fact without changing it: case, accents,
typographic quotes and dashes (the PDFs' "−" and "’" are ASCII "-" and "'" in a model's answer), backticks and
double quotes, runs of whitespace, and sentence punctuation at the ends. Everything else stays: "%j", "^W",
"C++", "hatch(NW)" are facts with their punctuation.

Pure: the caller supplies the asking (an ``Ask``: question and strategy to an Answer), so a test scores hand-made
answers and the command asks a real pipeline.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rag.answer import Answer
from retrieval.evaluate import LabelledQuestion, LabelsError, load_labels

# (question, strategy) -> the pipeline's answer with that strategy as its ``answer_mode``.
Ask = Callable[[str, str], Awaitable[Answer]]

_TYPOGRAPHIC = str.maketrans({
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u2032": "'",  # quotes and prime
    "\u201c": None, "\u201d": None, "\u201e": None, "\u2033": None,  # double quotes go, as '"' does below
    "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\u2212": "-",  # dashes, minus
    "\u00a0": " ",
    "`": None, '"': None,  # markdown code marks and quoting around a fact are not part of it
})
_ENDS = " .,;:"  # sentence punctuation around a fact ("HC3." is HC3); "!" and "?" stay: "a!" is a factorial


def normalise(text: str) -> str:
    """``text`` as answers are compared: NFKC, accents dropped, case folded, typographic quotes and dashes as ASCII,
    backticks and double quotes dropped, whitespace collapsed, sentence punctuation stripped at both ends."""
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if not unicodedata.combining(c)).casefold().translate(_TYPOGRAPHIC)
    return " ".join(text.split()).strip(_ENDS)


def occurs(label: str, answer: str) -> bool:
    """Whether normalised ``label`` occurs whole in normalised ``answer`` (module docstring: ``contains``)."""
    if not label:
        return False
    left = r"(?<!\w)" if label[0].isalnum() else ""
    right = r"(?!\w)" if label[-1].isalnum() else ""
    return re.search(left + re.escape(label) + right, answer) is not None


@dataclass(slots=True, frozen=True)
class AnswerLabel:
    """A labelled question and its short answer: ``answer`` None when the question's answer is not a few words
    read from the page (it counts for citations only)."""

    labelled: LabelledQuestion
    answer: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def forms(self) -> tuple[str, ...]:
        """The answer and its aliases, normalised; empty when there is no short answer."""
        if self.answer is None:
            return ()
        return tuple(dict.fromkeys(f for f in map(normalise, (self.answer, *self.aliases)) if f))


def load_answer_labels(path: Path) -> list[AnswerLabel]:
    """``path``: retrieval/evaluate.py's labels (read by its :func:`load_labels`, which ignores other fields) with
    ``"answer": str | null`` and ``"answer_aliases": [str, ...]`` on each line (mmrag/bench/realdocs/labels.jsonl)."""
    labelled = load_labels(path)
    rows = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
            if line.strip()]
    out = []
    for q, (n, line) in zip(labelled, rows, strict=True):
        row = json.loads(line)
        answer, aliases = row.get("answer"), row.get("answer_aliases", [])
        if not (answer is None or (isinstance(answer, str) and normalise(answer))) or not isinstance(aliases, list) \
                or not all(isinstance(a, str) and normalise(a) for a in aliases) or (aliases and answer is None):
            raise LabelsError(f"{path}, line {n}: `answer` must be a short non-empty string or null, and "
                              '`answer_aliases` a list of non-empty strings beside an answer, e.g. "answer": "HC3", '
                              '"answer_aliases": ["type HC3"]')
        out.append(AnswerLabel(q, answer, tuple(aliases)))
    return out


@dataclass(slots=True, frozen=True)
class Graded:
    """One answer to one labelled question. ``contains`` and ``exact`` are False without a short answer
    (``answerable`` False): such a question is left out of the answer scores, not failed."""

    id: str
    kind: str
    answerable: bool
    contains: bool
    exact: bool
    cited: bool


def grade(label: AnswerLabel, answer: str, cited: Iterable[tuple[str, int]]) -> Graded:
    """Scores ``answer`` (its text) and ``cited`` (its citations' (doc, page)) against ``label``."""
    forms, text = label.forms, normalise(answer)
    pages, q = set(cited), label.labelled
    return Graded(q.id, q.kind, bool(forms), any(occurs(f, text) for f in forms), text in forms,
                  q.answers <= pages if q.needs_all else bool(q.answers & pages))


def score(graded: Sequence[Graded]) -> dict[str, float | int]:
    """``contains`` and ``exact``: shares of the ``n_answer`` questions with a short answer; ``citations``: share
    of all ``n``."""
    answerable = [g for g in graded if g.answerable]
    n, m = len(graded), len(answerable)
    return {
        "contains": sum(g.contains for g in answerable) / m if m else 0.0,
        "exact": sum(g.exact for g in answerable) / m if m else 0.0,
        "citations": sum(g.cited for g in graded) / n if n else 0.0,
        "n": n,
        "n_answer": m,
    }


def summarise(graded: Sequence[Graded]) -> dict[str, Any]:
    """One strategy's report: ``overall``, ``by_kind`` (text, figure) and the ids that ``failed`` each score
    (``answer``: no ``contains`` match, among answerable questions; ``citations``: the labelled page uncited)."""
    kinds: dict[str, list[Graded]] = {}
    for g in graded:
        kinds.setdefault(g.kind, []).append(g)
    return {
        "overall": score(graded),
        "by_kind": {k: score(gs) for k, gs in sorted(kinds.items())},
        "failed": {"answer": [g.id for g in graded if g.answerable and not g.contains],
                   "citations": [g.id for g in graded if not g.cited]},
    }


@dataclass(slots=True)
class Asked:
    """One question asked with one strategy, as the report's ``answers`` list records it."""

    id: str
    strategy: str
    answer: str
    pages_cited: list[str]  # "doc:page", in citation order (``graded.cited``: whether they include the label's)
    answer_mode: str  # what the strategy chose (auto picks split or joint per question); "" when none was needed
    answer_mode_reason: str
    prompt_tokens: int
    completion_tokens: int
    graded: Graded


async def ask_all(labels: Sequence[AnswerLabel], strategies: Sequence[str], ask: Ask, *,
                  on_asked: Callable[[int, Asked], None] | None = None) -> list[Asked]:
    """Every question through every strategy, question by question (``on_asked(question index, asked)`` after
    each), one at a time: an evaluation measures answers, not throughput."""
    out = []
    for i, label in enumerate(labels):
        for strategy in strategies:
            answer = await ask(label.labelled.question, strategy)
            cited = [(c.doc, c.page) for c in answer.citations]
            asked = Asked(label.labelled.id, strategy, answer.answer, [f"{d}:{p}" for d, p in cited],
                          str(answer.extra.get("answer_mode", "")), str(answer.extra.get("answer_mode_reason", "")),
                          answer.usage.prompt_tokens, answer.usage.completion_tokens,
                          grade(label, answer.answer, cited))
            out.append(asked)
            if on_asked is not None:
                on_asked(i, asked)
    return out


def head_to_head(asked: Sequence[Asked], strategies: Sequence[str]) -> list[dict[str, Any]]:
    """For each pair of strategies, on the questions with a short answer: how many only the first gets right
    (``contains``), how many only the second, how many both or neither. A difference of a question or two is
    noise; the pairs say whether one strategy wins questions the other loses, or merely trades them."""
    graded = {(a.id, a.strategy): a.graded for a in asked}
    ids = list(dict.fromkeys(a.id for a in asked if a.graded.answerable))
    out = []
    for i, first in enumerate(strategies):
        for second in strategies[i + 1:]:
            pairs = [(graded[q, first].contains, graded[q, second].contains) for q in ids
                     if (q, first) in graded and (q, second) in graded]
            out.append({"first": first, "second": second, "only_first": sum(a and not b for a, b in pairs),
                        "only_second": sum(b and not a for a, b in pairs), "same": sum(a == b for a, b in pairs)})
    return out


def report(labels: Sequence[AnswerLabel], strategies: Sequence[str], asked: Sequence[Asked]) -> dict[str, Any]:
    """``strategies``: {strategy: :func:`summarise` plus ``chosen`` (how often each answer mode was chosen: what
    auto did) and mean ``prompt_tokens`` and ``completion_tokens`` per question (cost, independent of the prefix
    cache that later strategies find warm)}; ``head_to_head``: :func:`head_to_head`; ``answers``: every
    :class:`Asked`."""
    per: dict[str, Any] = {}
    for s in strategies:
        mine = [a for a in asked if a.strategy == s]
        chosen: dict[str, int] = {}
        for a in mine:
            chosen[a.answer_mode or "none"] = chosen.get(a.answer_mode or "none", 0) + 1
        n = len(mine) or 1
        per[s] = {**summarise([a.graded for a in mine]), "chosen": dict(sorted(chosen.items())),
                  "prompt_tokens": round(sum(a.prompt_tokens for a in mine) / n, 1),
                  "completion_tokens": round(sum(a.completion_tokens for a in mine) / n, 1)}
    return {
        "questions": len(labels),
        "with_answer": sum(bool(q.forms) for q in labels),
        "strategies": per,
        "head_to_head": head_to_head(asked, strategies),
        "answers": [{**{k: v for k, v in asdict(a).items() if k != "graded"},
                     **{k: v for k, v in asdict(a.graded).items() if k not in ("id",)}} for a in asked],
    }
