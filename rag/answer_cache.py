"""The answer cache (issue 40): a repeated question is answered from the answer it got before, with no engine
request.

With greedy decoding an answer is a function of what the prompts are made of. :func:`answer_key` hashes all of
it: the tenant, the question (normalised: case, spacing and a trailing ``?``/``.``/``!`` do not count), the
question's images (a conversation's included), the sub-questions and the pages shown (their image keys, which
carry content hash, encoder version and resolution policy, in prompt order; and their page ids, which the
prompts' labels and the citations name), the model, the prompt version, the answer strategy, the answer's
length and the question's filters. Any change of one is another key: a miss. Sampled answers (temperature > 0)
are never looked up or stored: the caller checks (the pipeline, rag/pipeline.py).

An entry keeps the answer's text pieces in the order they were streamed, so a hit streams the same way, and the
answer's JSON. It records its own key: an entry read under another key (a renamed file) is refused like any
other unreadable entry, which is a miss (and is removed), never an error to the user. A store that fails (Redis
down, the disk full) is logged and answers as a miss too: the answer is computed as if there were no cache.

Entries are bounded per tenant (MMRAG_ANSWER_CACHE_MAX_PER_TENANT, least recently used out first) and kept in
Redis when MMRAG_REDIS_URL is set, else on disk (mmrag/adapters/answer_store.py). docs/answer-cache.md is the user's
side of it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mmrag.adapters.answer_store import AnswerStore, AnswerStoreError
from mmrag.core.keys import ImageKey
from mmrag.core.settings import check_tenant
from mmrag.core.text import normalise

log = logging.getLogger(__name__)

# Part of every key: bump it when what a key is made of, or how, changes (old entries then age out unread).
KEY_VERSION = "answer-key-v1"
# The entry's own format (CachedAnswer.encode); an entry of another format is a miss.
ENTRY_FORMAT = 1

Outcome = Literal["hit", "miss"]
_TRAILING = re.compile(r"[\s?.!]+$")


def normalise_question(question: str) -> str:
    """The question as the key sees it: the one text normaliser's output (mmrag/core/text.normalise: NFKC, typographic
    quotes and dashes folded, ...), case-folded, every run of whitespace one space, trailing ``?``/``.``/``!``
    (and spaces) dropped. "What is X?" and "  what is  x " are one question."""
    return _TRAILING.sub("", " ".join(normalise(question).casefold().split()))


def prompt_version(*texts: str) -> str:
    """A short hash of the texts that shape an answer besides the question and pages: 16 hex digits.

    The caller passes them, since the system prompts live in the serving layer (serving/engine/prompt.py
    ``SYSTEM_PROMPTS``, which this layer may not import): every system prompt (name and text), a version string
    of the prompt templates (rag/plans.py's wording of a prompt's text), and any setting that changes prompts or
    decoding without being another :func:`answer_key` field (the decomposer, MMRAG_SUB_ANSWER_MAX_TOKENS,
    MMRAG_ONE_PROMPT_PAGES, MMRAG_FIGURE_CROPS, MMRAG_ANSWER_FIXED_LENGTH, ...), each as ``name=value``.
    Order matters; pass them in a fixed order (e.g. system prompts sorted by name)."""
    blob = json.dumps(list(texts), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def answer_key(*, tenant: str, question: str, images: Sequence[ImageKey], sub_questions: Sequence[str],
               pages: Sequence[ImageKey], page_ids: Sequence[str], model: str, prompt_version: str, strategy: str,
               max_tokens: int, docs: Sequence[str] | None, tier: str | None) -> str:
    """The cache key of an answer (sha256 hex) over a canonical JSON of what makes it.

    ``images``: the question's own images, a conversation's earlier ones included, in prompt order.
    ``sub_questions``: as the prompts carry them (they are prompt text, and the model may write them).
    ``pages``: the image keys shown, in prompt order (order changes a prompt, so it changes the key); a figure's
    crop is its own key. ``page_ids``: the cited pages' ids in citation order: the prompts label pages by document
    and number and the answer's citations name them, so the same image in another document is another answer.
    ``model``: the served model's identity (its name or checkpoint). ``strategy``: the answer mode the answer was
    made with ("split" or "joint"). ``docs``: the question's document filter (None: all; order does not
    matter). ``tier``: the resolution tier asked for (None: standard)."""
    fields = {
        "v": KEY_VERSION,
        "tenant": check_tenant(tenant),
        "question": normalise_question(question),
        "images": [str(k) for k in images],
        "sub_questions": list(sub_questions),
        "pages": [str(k) for k in pages],
        "page_ids": list(page_ids),
        "model": model,
        "prompt_version": prompt_version,
        "strategy": strategy,
        "max_tokens": int(max_tokens),
        "docs": sorted(set(docs)) if docs is not None else None,
        "tier": tier,
    }
    canonical = json.dumps(fields, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class CorruptAnswerError(ValueError):
    """An entry that is not a whole, well-formed CachedAnswer of its key: dropped, and the question answered."""


@dataclass(slots=True)
class CachedAnswer:
    """A cold answer as it was served: ``deltas``, the answer's text pieces in the order they were streamed; and
    ``answer``, its ``Answer.to_json()`` (the pipeline sets its usage's ``answer_cache`` when serving it)."""

    deltas: list[str]
    answer: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"deltas": list(self.deltas), "answer": self.answer}

    @classmethod
    def from_json(cls, data: Any) -> CachedAnswer:
        """The inverse of :meth:`to_json`; CorruptAnswerError when ``data`` is not of that shape."""
        if not isinstance(data, dict):
            raise CorruptAnswerError(f"an answer entry is a JSON object, got {type(data).__name__}")
        deltas, answer = data.get("deltas"), data.get("answer")
        if not isinstance(deltas, list) or not all(isinstance(d, str) for d in deltas):
            raise CorruptAnswerError("an answer entry's `deltas` is a list of strings")
        if not isinstance(answer, dict):
            raise CorruptAnswerError("an answer entry's `answer` is a JSON object")
        return cls(deltas, answer)

    def encode(self, key: str) -> bytes:
        """The stored form: UTF-8 JSON with the entry's format and its own key."""
        entry = {"format": ENTRY_FORMAT, "key": key, **self.to_json()}
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, blob: bytes, key: str) -> CachedAnswer:
        """The entry stored under ``key``; CorruptAnswerError when it is unreadable, of another format or
        another key's."""
        try:
            entry = json.loads(blob)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptAnswerError(f"not JSON ({exc})") from exc
        if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT:
            raise CorruptAnswerError(f"not an answer entry of format {ENTRY_FORMAT}")
        if entry.get("key") != key:
            raise CorruptAnswerError(f"the entry belongs to the key {entry.get('key')!r}")
        return cls.from_json(entry)


@dataclass(slots=True)
class AnswerCacheStats:
    """Counts since the cache was opened (lookups are hits + misses; a corrupt entry or a failed read is a
    miss too, and counted again in ``corrupt`` / ``errors``)."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0


class AnswerCache:
    """Answers by (tenant, key) over an :class:`AnswerStore`, at most ``max_per_tenant`` per tenant.

    ``on_lookup`` is called with "hit" or "miss" after each :meth:`get` (serving/metrics ``record_answer_cache``);
    the counts are in ``stats`` as well. Store I/O runs in a worker thread: the store's calls block."""

    def __init__(self, store: AnswerStore, *, max_per_tenant: int,
                 on_lookup: Callable[[Outcome], None] | None = None) -> None:
        if max_per_tenant < 1:
            raise ValueError(f"max_per_tenant must be at least 1, got {max_per_tenant}; to turn the answer cache "
                             "off set MMRAG_ANSWER_CACHE=false")
        self.store = store
        self.max_per_tenant = max_per_tenant
        self.on_lookup = on_lookup
        self.stats = AnswerCacheStats()

    @property
    def backend(self) -> str:
        return self.store.backend

    async def get(self, tenant: str, key: str) -> CachedAnswer | None:
        """The cached answer, or None (a miss): none stored, a corrupt entry (removed), or the store failing."""
        value = None
        try:
            blob = await asyncio.to_thread(self.store.get, tenant, key)
            if blob is not None:
                value = CachedAnswer.decode(blob, key)
        except CorruptAnswerError as exc:
            self.stats.corrupt += 1
            log.warning("answer cache: dropping the %s entry %s of tenant %s: %s", self.backend, key, tenant, exc)
            await self._drop(tenant, key)
        except AnswerStoreError as exc:
            self.stats.errors += 1
            log.warning("answer cache: lookup failed, answering without the cache: %s", exc)
        self._record("hit" if value is not None else "miss")
        return value

    async def put(self, tenant: str, key: str, value: CachedAnswer) -> None:
        """Keep ``value`` as the tenant's most recent entry (the least recently used beyond the bound go). A store
        failure is logged, not raised: the answer it would keep has been served already."""
        blob = value.encode(key)
        try:
            evicted = await asyncio.to_thread(self.store.put, tenant, key, blob, keep=self.max_per_tenant)
        except AnswerStoreError as exc:
            self.stats.errors += 1
            log.warning("answer cache: could not keep an answer: %s", exc)
            return
        self.stats.writes += 1
        self.stats.evictions += evicted

    async def _drop(self, tenant: str, key: str) -> None:
        try:
            await asyncio.to_thread(self.store.delete, tenant, key)
        except AnswerStoreError as exc:  # the next put over it replaces it anyway
            self.stats.errors += 1
            log.warning("answer cache: could not remove a corrupt entry: %s", exc)

    def _record(self, outcome: Outcome) -> None:
        if outcome == "hit":
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        if self.on_lookup is not None:
            self.on_lookup(outcome)
