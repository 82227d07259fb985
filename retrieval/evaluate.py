"""Retrieval quality on a labelled corpus: recall@1, recall@5 and MRR per channel.

A hit is correct when its (file name, page) is one of the question's answer pages; verbatim copies of a
page in several files are all listed as answers, so finding any copy counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retrieval.search import Channel, Hit, PageSearcher

DEPTH = 5  # recall@5 and MRR look at the first five hits


@dataclass(slots=True, frozen=True)
class LabelledQuestion:
    question: str
    answers: frozenset[tuple[str, int]]  # (file name, 1-based page) of every page that answers it


async def evaluate(
    searcher: PageSearcher, labelled: Sequence[LabelledQuestion], channels: Sequence[Channel]
) -> dict[str, dict[str, float | int]]:
    """``{channel: {"recall@1", "recall@5", "mrr", "n"}}``; all questions of a channel in one batch."""
    questions = [q.question for q in labelled]
    answers = [q.answers for q in labelled]
    out: dict[str, dict[str, float | int]] = {}
    for channel in channels:
        hits = await searcher.search_many(questions, top_k=DEPTH, channels=channel)
        ranks = [first_correct_rank(h, a) for h, a in zip(hits, answers)]
        out[Channel(channel).value] = score_ranks(ranks)
    return out


def first_correct_rank(hits: list[Hit], answers: frozenset[tuple[str, int]]) -> int | None:
    """1-based rank of the first hit on an answer page, None when none of the hits is."""
    for rank, hit in enumerate(hits[:DEPTH], start=1):
        if (hit.doc, hit.page) in answers:
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
    image-only search with random CLIP weights should sit near."""
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
