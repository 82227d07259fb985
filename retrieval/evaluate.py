"""Retrieval quality on labelled questions: recall@1, recall@5, MRR and, for questions that need several pages,
the share with every needed page found, per channel and fused.

A question is labelled with its answer pages and whether it needs ``any`` of them (the same content on several
pages, or verbatim copies of a page in several files: finding one counts) or ``all`` of them (a comparison, a
figure read with text elsewhere). For an ``all`` question, recall@k and MRR look at its first needed page found,
and ``all@5`` at whether every needed page is among the first five.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mmrag.core.payload import PagePayload
from retrieval.search import Channel, Hit, PageSearcher

DEPTH = 5  # recall@5, MRR and all@5 look at the first five hits


@dataclass(slots=True, frozen=True)
class LabelledQuestion:
    question: str
    answers: frozenset[tuple[str, int]]  # (file name, 1-based page) of every page that answers it
    needs_all: bool = False  # every answer page is needed (a multi-page question), not any one of them
    kind: str = "text"  # text | figure: what the question asks about
    id: str = ""


class LabelsError(ValueError):
    """A labels file that cannot be read as labelled questions; the message names the line and the fix."""


def load_labels(path: Path) -> list[LabelledQuestion]:
    """``path``: JSON lines, each {"question", "pages": [{"doc", "page"}, ...], "needs": "any"|"all", "kind",
    "id"} (mmrag/bench/realdocs/labels.jsonl is one)."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pages = frozenset((str(p["doc"]), int(p["page"])) for p in row["pages"])
            needs = row.get("needs", "any")
            if not row["question"].strip() or not pages or needs not in ("any", "all"):
                raise ValueError("an empty question, no pages, or `needs` other than any/all")
            out.append(LabelledQuestion(row["question"], pages, needs == "all", str(row.get("kind", "text")),
                                        str(row.get("id", f"line-{n}"))))
        except (ValueError, KeyError, TypeError) as exc:
            raise LabelsError(f"{path}, line {n}: not a labelled question ({exc}). Each line is a JSON object like "
                              '{"question": "...", "pages": [{"doc": "manual.pdf", "page": 12}], "needs": "any", '
                              '"kind": "text"}') from exc
    if not out:
        raise LabelsError(f"{path} holds no labelled question: write one JSON object per line")
    return out


async def evaluate(
    searcher: PageSearcher, labelled: Sequence[LabelledQuestion], channels: Sequence[Channel]
) -> dict[str, dict[str, float | int]]:
    """``{channel: scores}`` (see :func:`score`); every channel from one batch (HYBRID: each channel that is on
    and the fusion from the same round trip), else one batch per channel."""
    questions = [q.question for q in labelled]
    wanted = [Channel(c) for c in channels]
    found: dict[Channel, list[list[Hit]]] = {}
    if Channel.HYBRID in wanted:
        found |= await searcher.search_channels(questions, top_k=DEPTH, channels=Channel.HYBRID)
    for channel in wanted:
        if channel not in found:
            found[channel] = await searcher.search_many(questions, top_k=DEPTH, channels=channel)
    return {c.value: score(found[c], labelled) for c in wanted}


def score(hits: Sequence[Sequence[Hit]] | Sequence[Sequence[tuple[str, int]]], labelled: Sequence[LabelledQuestion]
          ) -> dict[str, float | int]:
    """recall@1, recall@5, MRR@5 over all questions; all@5 over the multi-page ones (every needed page in the
    first five), with ``n`` and ``n_multi``. ``hits``: per question, its hits or (doc, page) pairs, best first."""
    pages = [[(h.doc, h.page) if isinstance(h, Hit) else tuple(h) for h in hs] for hs in hits]
    ranks = [first_correct_rank(p, q.answers) for p, q in zip(pages, labelled)]
    out = score_ranks(ranks)
    multi = [(p, q) for p, q in zip(pages, labelled) if q.needs_all]
    out["n_multi"] = len(multi)
    out["all@5"] = sum(q.answers <= set(p[:DEPTH]) for p, q in multi) / len(multi) if multi else 0.0
    return out


def by_kind(hits: Sequence[Sequence[Hit]], labelled: Sequence[LabelledQuestion]) -> dict[str, dict[str, float | int]]:
    """:func:`score` per question kind (text, figure)."""
    kinds: dict[str, list[int]] = {}
    for i, q in enumerate(labelled):
        kinds.setdefault(q.kind, []).append(i)
    return {k: score([hits[i] for i in idx], [labelled[i] for i in idx]) for k, idx in sorted(kinds.items())}


MISS_TEXT_CHARS = 200  # of a needed page's text, in a miss's report


def misses(cited: Sequence[Sequence[tuple[str, int]]], hybrid: Sequence[Sequence[Hit]],
           labelled: Sequence[LabelledQuestion], pages: Mapping[tuple[str, int], PagePayload] | None = None
           ) -> list[dict]:
    """The questions whose answer does not cite what they need (any labelled page, or every one of a multi-page
    question, among its first DEPTH cited pages), each with why it can be read: the pages it needed, the fused
    ranking's rank of each (None: not among its candidates), and the pages cited instead; with ``pages`` (the
    index's payloads by (doc, page)), each needed page's figures (number and caption) and the start of its text."""
    out = []
    for cites, hits, q in zip(cited, hybrid, labelled):
        shown = [tuple(c) for c in cites[:DEPTH]]
        found = q.answers <= set(shown) if q.needs_all else bool(q.answers & set(shown))
        if found:
            continue
        ranked = [(h.doc, h.page) for h in hits]
        ranks = {f"{doc} p{page}": (ranked.index((doc, page)) + 1 if (doc, page) in ranked else None)
                 for doc, page in sorted(q.answers)}
        row = {"id": q.id, "kind": q.kind, "needs": "all" if q.needs_all else "any", "question": q.question,
               "hybrid_rank": ranks, "cited": [f"{doc} p{page}" for doc, page in shown]}
        if pages is not None:
            row["needed"] = {f"{doc} p{page}": _described(pages.get((doc, page))) for doc, page in sorted(q.answers)}
        out.append(row)
    return out


def _described(page: PagePayload | None) -> dict:
    if page is None:
        return {"indexed": False}
    return {"figures": [f"{f.region.kind} {f.region.number if f.region.number is not None else '-'}: "
                        f"{f.region.caption or '(no caption)'}" for f in page.figures],
            "text": " ".join(page.text.split())[:MISS_TEXT_CHARS]}


def first_correct_rank(hits: Sequence[Hit] | Sequence[tuple[str, int]], answers: frozenset[tuple[str, int]]
                       ) -> int | None:
    """1-based rank of the first hit on an answer page, None when none of the first DEPTH is."""
    for rank, hit in enumerate(hits[:DEPTH], start=1):
        if ((hit.doc, hit.page) if isinstance(hit, Hit) else tuple(hit)) in answers:
            return rank
    return None


def score_ranks(ranks: list[int | None]) -> dict[str, float | int]:
    n = len(ranks)
    if n == 0:
        return {"recall@1": 0.0, "recall@5": 0.0, "mrr": 0.0, "n": 0}
    return {
        "recall@1": sum(r == 1 for r in ranks) / n,
        "recall@5": sum(r is not None and r <= 5 for r in ranks) / n,
        "mrr": sum(1 / r for r in ranks if r is not None) / n,  # MRR@5: a miss in the top 5 counts 0
        "n": n,
    }


def chance_recall(labelled: Sequence[LabelledQuestion], indexed_pages: int, k: int = DEPTH) -> float:
    """Expected recall@k of a ranking drawn at random from ``indexed_pages`` pages: the floor that
    image-only search with random weights should sit near."""
    if indexed_pages <= 0 or not labelled:
        return 0.0
    k = min(k, indexed_pages)
    total = 0.0
    for q in labelled:
        miss = 1.0  # P(none of the k drawn pages is an answer page), drawing without replacement
        for i in range(k):
            miss *= max(indexed_pages - len(q.answers) - i, 0) / (indexed_pages - i)
        total += 1.0 - miss
    return total / len(labelled)


def unknown_docs(labelled: Sequence[LabelledQuestion], indexed: Mapping[str, int]) -> list[str]:
    """Labelled (doc, page) pairs not in ``indexed`` ({file name: pages}): a label file for other documents."""
    return sorted({f"{d}:{p}" for q in labelled for d, p in q.answers if not 1 <= p <= indexed.get(d, 0)})
