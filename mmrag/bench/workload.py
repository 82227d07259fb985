"""The benchmark workload and its oracle bound: pure functions over page indices, no engine.

A question has 2-4 sub-questions; each "retrieves" 1-2 distinct pages drawn from a Zipf law over page
popularity (page 0 the most popular), in the order drawn — that order is the retrieval-score order, which
the naive layout keeps and the canonical layout replaces. Questions arrive as a Poisson process at a set
rate, or in a closed loop at a set concurrency (the runner's choice; arrival times are drawn here).

The position oracle (image-token hit rate), from the workload alone:

- cold: every use of a page after its first use can hit;
- warm: every use of a page that fits in the KV cache can hit (pages ranked by their uses in the workload,
  each costing a single-page prompt's blocks), the others as cold.

Both are computed over the prompts rendered in the canonical layout, so every configuration on the same
image keys (full or budget resolution) is measured against the same number.

In tokens: consecutive hitting images of a prompt form a run, and the run's image tokens that lie in full
KV blocks count (the engine caches full blocks only, so the block holding a run's last image tokens and
the next, different tokens never hits). The bound ignores that a prefix cache needs the whole prefix before
an image to match, so :func:`prefix_bound` gives the tighter figure a prefix cache can reach with a layout,
computed on the prompts' tokens: an image at position ``i`` hits only if the same tokens up to it (the same
first ``i + 1`` images, behind the same text) were seen before.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    questions: int
    pages: int
    zipf_s: float = 1.0
    sub_questions: tuple[int, int] = (2, 4)  # inclusive range
    pages_per_sub: tuple[int, int] = (1, 2)
    rate_qps: float | None = None  # Poisson arrivals; None: closed loop
    concurrency: int = 4  # questions in flight in the closed loop
    max_tokens: int = 4  # the answer's tokens: per request per sub-question, per question for mmrag's strategies
    seed: int = 0


@dataclass(slots=True, frozen=True)
class SubQuestion:
    text: str
    pages: tuple[int, ...]  # page indices in retrieval-score order, best first


@dataclass(slots=True, frozen=True)
class Question:
    qid: int
    subs: tuple[SubQuestion, ...]
    arrival_s: float  # offset from the start (Poisson); 0 in the closed loop

    @property
    def text(self) -> str:
        """The compound question the sub-questions come from, as a user types it: one after the other (mmrag's
        strategies' prompts end with it, and auto reads its words: a "Compare ..." part makes it joint; derived, so
        the workload's draws and every other configuration stay as they were)."""
        return " ".join(s.text for s in self.subs)


@dataclass(slots=True)
class Workload:
    spec: WorkloadSpec
    questions: list[Question]

    def page_uses(self) -> Counter[int]:
        return Counter(p for q in self.questions for s in q.subs for p in s.pages)

    def describe(self) -> dict:
        uses = self.page_uses()
        subs = [len(q.subs) for q in self.questions]
        per_sub = [len(s.pages) for q in self.questions for s in q.subs]
        return {
            **asdict(self.spec),
            "arrivals": "poisson" if self.spec.rate_qps else "closed-loop",
            "sub_questions_total": len(per_sub),
            "page_uses": sum(uses.values()),
            # Each question's distinct pages: what one prompt per question shows, each page once.
            "question_page_uses": sum(len({p for s in q.subs for p in s.pages}) for q in self.questions),
            "distinct_pages_used": len(uses),
            "mean_sub_questions": round(float(np.mean(subs)), 3) if subs else 0.0,
            "mean_pages_per_sub": round(float(np.mean(per_sub)), 3) if per_sub else 0.0,
            "top_page_share": round(uses.most_common(1)[0][1] / sum(uses.values()), 3) if uses else 0.0,
            # Page uses that are not the first image of their sub-question: a prefix cache reuses them only
            # behind the same first page.
            "later_position_share": round(1 - len(per_sub) / sum(per_sub), 3) if per_sub else 0.0,
        }


_TOPICS = ("revenue", "latency", "headcount", "storage", "churn", "adoption", "margin", "backlog")
_ASKS = ("What is the trend of", "Which quarter peaks in", "How large is the change in",
         "Summarise the figure on", "What is the largest segment of", "Compare the series of")


def zipf_probabilities(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return weights / weights.sum()


def make_workload(spec: WorkloadSpec) -> Workload:
    rng = np.random.default_rng([spec.seed, zlib.crc32(b"workload")])
    probs = zipf_probabilities(spec.pages, spec.zipf_s)
    lo, hi = spec.sub_questions
    plo, phi = spec.pages_per_sub
    questions, t = [], 0.0
    for qid in range(spec.questions):
        if spec.rate_qps:
            t += float(rng.exponential(1.0 / spec.rate_qps))
        subs = []
        for j in range(int(rng.integers(lo, hi + 1))):
            k = min(spec.pages, int(rng.integers(plo, phi + 1)))
            pages = tuple(int(p) for p in rng.choice(spec.pages, size=k, replace=False, p=probs))
            ask = _ASKS[int(rng.integers(len(_ASKS)))]
            topic = _TOPICS[int(rng.integers(len(_TOPICS)))]
            subs.append(SubQuestion(f"Q{qid}.{j + 1}: {ask} {topic} shown here?", pages))
        questions.append(Question(qid, tuple(subs), t if spec.rate_qps else 0.0))
    return Workload(spec, questions)


# --- the oracle --------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class PromptImages:
    """The images of one prompt, in submission order, where their tokens sit in the prompt, and the prompt's
    tokens as a prefix cache sees them (:func:`cache_tokens`; needed by :func:`prefix_bound` only)."""

    keys: tuple[Hashable, ...]
    spans: tuple[tuple[int, int], ...]  # (first token, tokens) per image
    tokens: tuple[Hashable, ...] = ()


def cache_tokens(ids: Sequence[int], pad_id: int, keys: Sequence[Hashable], counts: Sequence[int]
                 ) -> tuple[Hashable, ...]:
    """A prompt's token ids with each image placeholder expanded to its image's tokens, ``(key, i)``: equal
    where a prefix cache's block hashes are equal (vLLM hashes a block's token ids with the images in it)."""
    out: list[Hashable] = []
    images = iter(zip(keys, counts))
    for t in ids:
        if t == pad_id:
            key, n = next(images)
            out += [(key, i) for i in range(n)]
        else:
            out.append(t)
    return tuple(out)


def _run_tokens(p: PromptImages, first: int, last: int, block_size: int) -> int:
    """Image tokens of images ``first..last`` that lie in full blocks of the run they form.

    The run ends at a block boundary (only full blocks are cached). A run at position 0 follows the shared
    system prompt, so it starts where its first image starts; a later run starts at the next boundary.
    """
    start = p.spans[first][0] if first == 0 else -(-p.spans[first][0] // block_size) * block_size
    end = (p.spans[last][0] + p.spans[last][1]) // block_size * block_size
    return sum(max(0, min(end, s + n) - max(start, s)) for s, n in p.spans[first:last + 1])


def _hit_tokens(p: PromptImages, hittable: list[bool], block_size: int) -> int:
    hit, i = 0, 0
    while i < len(hittable):
        if not hittable[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(hittable) and hittable[j + 1]:
            j += 1
        hit += _run_tokens(p, i, j, block_size)
        i = j + 1
    return hit


def fits_in_kv(prompts: Sequence[PromptImages], capacity_tokens: int, block_size: int) -> set[Hashable]:
    """Pages that fit in the KV cache together, most used first; each costs a single-page prompt's blocks."""
    counts = Counter(k for p in prompts for k in p.keys)
    tokens = {k: n for p in prompts for k, (_, n) in zip(p.keys, p.spans)}
    system = min((p.spans[0][0] for p in prompts if p.spans), default=0)
    chosen, used, budget = set(), 0, capacity_tokens // block_size
    for key, _ in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        cost = math.ceil((system + tokens[key]) / block_size)
        if used + cost <= budget:
            chosen.add(key)
            used += cost
    return chosen


def oracle_bound(prompts: Sequence[PromptImages], block_size: int, warm: set[Hashable] | None = None) -> float:
    """The issue's bound: every use of a page after its first (or of a warm page) hits, wherever it sits."""
    total = sum(n for p in prompts for _, n in p.spans)
    seen: set[Hashable] = set(warm or ())
    hit = 0
    for p in prompts:
        hit += _hit_tokens(p, [k in seen for k in p.keys], block_size)
        seen.update(p.keys)
    return hit / total if total else 0.0


def prefix_bound(prompts: Sequence[PromptImages], block_size: int, seen: Sequence[PromptImages] = ()) -> float:
    """What a prefix cache of unbounded size can reach with these prompts, in image tokens: a prompt reuses
    its leading full blocks that an earlier prompt (or one of ``seen``: the warm-up's, or the floor's prefill)
    had, token for token — never its last token, which vLLM always computes.

    Independent of the order the prompts run in: each distinct chain of blocks misses exactly once.
    """
    total = sum(n for p in prompts for _, n in p.spans)
    cache: set[int] = set()

    def chain(p: PromptImages) -> list[int]:
        hashes, h = [], 0
        for b in range(len(p.tokens) // block_size):
            h = hash((h, p.tokens[b * block_size:(b + 1) * block_size]))
            hashes.append(h)
        return hashes

    for p in seen:
        cache.update(chain(p))
    hit = 0
    for p in prompts:
        hashes = chain(p)
        limit = min(len(hashes), (len(p.tokens) - 1) // block_size)
        matched = 0
        while matched < limit and hashes[matched] in cache:
            matched += 1
        cached = matched * block_size
        hit += sum(max(0, min(start + n, cached) - start) for start, n in p.spans)
        cache.update(hashes)
    return hit / total if total else 0.0
