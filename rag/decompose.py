"""Question decomposition: a compound question becomes a few self-contained sub-questions.

Two paths, and the result says which one produced the sub-questions:

- the model (:class:`ModelDecomposer`): one greedy request with guided decoding, so the reply always has the
  JSON shape; the reply is then checked (:func:`validate_sub_questions`), because a shape is not a meaning;
- the rules (:class:`RuleDecomposer`): deterministic splitting on "?", ";", coordinating conjunctions, lists
  under a shared predicate and "compare" forms. Used when the model's reply is rejected or no model is given.

:class:`Decomposer` checks the question, tries the model and falls back to the rules, recording why.
:class:`MMRAGQuestionGenerator` lets llama-index's ``SubQuestionQueryEngine`` use it.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
import unicodedata
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.question_gen.types import BaseQuestionGenerator, SubQuestion
from llama_index.core.schema import QueryBundle
from llama_index.core.tools.types import ToolMetadata

from mmrag.core.engine import Completion, Engine, PromptPlan, SamplingSpec
from mmrag.core.settings import default_of

MAX_QUESTION_CHARS = default_of("max_question_chars")  # declared once, in mmrag/core/settings.py
EMPTY_QUESTION = 'the question is empty: send a question, e.g. "What does the chart on page 2 show?"'

Source = Literal["model", "rules"]


@dataclass(frozen=True, slots=True)
class Decomposition:
    sub_questions: list[str]
    source: Source
    rejected_reason: str | None  # why the model's reply was rejected; None when it was used or not asked
    # Why the parts need their pages seen together (the model said so: ``"together": true``); None when it did
    # not say so or was not asked. rag/plans.choose_answer reads it beside the question's own words.
    relates: str | None = None


class BadQuestionError(ValueError):
    """The question cannot be decomposed as given (the API answers 400 with this message)."""


def check_question(question: str, *, limit: int = MAX_QUESTION_CHARS) -> str:
    """The question with its whitespace collapsed, or BadQuestionError saying what to change."""
    stripped = question.strip()
    if not stripped:
        raise BadQuestionError(EMPTY_QUESTION)
    if len(stripped) > limit:
        raise BadQuestionError(f"question too long ({len(stripped)} chars, limit {limit}): shorten it")
    return " ".join(stripped.split())


# --- words -------------------------------------------------------------------------------------------------

STOPWORDS = frozenset(
    """
    a an the this that these those its it their they them his her our your my we you i me he she
    and or but nor also as well versus vs plus than then so
    what which who whom whose when where why how many much long often
    is are was were be been being am do does did done has have had can could should would will shall may
    might must not no there here
    of for in at on from with during per across under over about to into by between among within via
    compare compared comparison difference differences describe explain list summarize summarise show give
    find tell name identify outline please
    """.split()
)

_WORD = re.compile(r"[a-z0-9]+")


def _stem(word: str) -> str:
    """Simple plural stripping; the same function runs on both sides of every comparison."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("sses", "xes", "ches", "shes")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def content_words(text: str) -> frozenset[str]:
    """Lowercased words minus stopwords and single letters, plurals stripped."""
    words = _WORD.findall(text.lower())
    return frozenset(_stem(w) for w in words if w not in STOPWORDS and (len(w) > 1 or w.isdigit()))


def _key(text: str) -> str:
    """What two sub-questions must share to count as duplicates."""
    return " ".join(text.lower().split()).rstrip("?.!;: ")


# --- the model's reply: a pure check -----------------------------------------------------------------------


class Rejection(str, enum.Enum):
    MALFORMED = "malformed"  # not JSON
    SCHEMA = "schema"  # JSON, but not {"sub_questions": [str, ...]}
    COUNT = "count"  # none, or more than max_n
    LENGTH = "length"  # an empty or over-long sub-question
    DUPLICATE = "duplicate"
    UNGROUNDED = "ungrounded"  # a sub-question shares no content word with the question
    CONTROL = "control"  # a control character inside a sub-question
    TRUNCATED = "truncated"  # the model stopped at max_tokens


class RejectedDecomposition(ValueError):
    def __init__(self, kind: Rejection, detail: str) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind


def _excerpt(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def sub_question_schema(max_n: int, max_len: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "sub_questions": {
                "type": "array",
                "items": {"type": "string", "minLength": 3, "maxLength": max_len},
                "minItems": 1,
                "maxItems": max_n,
            },
            # true when the parts must be answered over their pages seen together (a comparison): one prompt
            "together": {"type": "boolean"},
        },
        "required": ["sub_questions"],
        "additionalProperties": False,
    }


def validate_sub_questions(raw: str, question: str, *, max_n: int, max_len: int) -> list[str]:
    """The sub-questions in ``raw`` (the model's JSON), or RejectedDecomposition naming the first problem.

    Guided decoding guarantees the shape only where the server honours the schema; everything is checked
    again here, and grounding (every sub-question shares a content word with the question) is what a shape
    cannot express: it rejects invented topics, and all of a random-weight model's text. Grounding is checked
    before control characters: of the two, it says more about a reply.
    """
    try:
        # strict=False: raw control characters inside strings. xgrammar 0.2.8 compiles a string with
        # minLength/maxLength to [^"\\\r\n]{3,200}, which admits them (and no escapes), so guided output is
        # not always strict JSON; they are rejected below, with a reason, instead of as "not JSON".
        data = json.loads(raw, strict=False)
    except json.JSONDecodeError as exc:
        raise RejectedDecomposition(Rejection.MALFORMED, f"not JSON ({exc.msg}): {_excerpt(raw)!r}") from None
    if not isinstance(data, dict) or "sub_questions" not in data or not set(data) <= {"sub_questions", "together"}:
        raise RejectedDecomposition(Rejection.SCHEMA, f"expected {{\"sub_questions\": [...]}}, got {_excerpt(raw)!r}")
    if not isinstance(data.get("together", False), bool):
        raise RejectedDecomposition(Rejection.SCHEMA, f"'together' is not true or false: {_excerpt(raw)!r}")
    items = data["sub_questions"]
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise RejectedDecomposition(Rejection.SCHEMA, f"'sub_questions' is not a list of strings: {_excerpt(raw)!r}")
    if not 1 <= len(items) <= max_n:
        raise RejectedDecomposition(Rejection.COUNT, f"{len(items)} sub-questions, expected 1 to {max_n}")
    subs = [" ".join(s.split()) for s in items]
    for raw_item, sub in zip(items, subs):
        if not sub or len(raw_item) > max_len:
            raise RejectedDecomposition(
                Rejection.LENGTH, f"sub-question of {len(raw_item)} chars, expected 1 to {max_len}: {_excerpt(sub)!r}"
            )
    seen: set[str] = set()
    for sub in subs:
        if _key(sub) in seen:
            raise RejectedDecomposition(Rejection.DUPLICATE, f"{_excerpt(sub)!r} appears more than once")
        seen.add(_key(sub))
    asked = content_words(question)
    for sub in subs:
        if not content_words(sub) & asked:
            raise RejectedDecomposition(
                Rejection.UNGROUNDED, f"sub-question {_excerpt(sub)!r} shares no content word with the question"
            )
    for sub in subs:
        if any(unicodedata.category(c) == "Cc" for c in sub):
            raise RejectedDecomposition(Rejection.CONTROL, f"sub-question {_excerpt(sub)!r} has control characters")
    return subs


# --- the rules ---------------------------------------------------------------------------------------------

_QWORD = r"(?:what|which|who|whom|whose|when|where|why|how(?: many| much| long| often| far| large| big| fast| old)?)"
_AUX = r"(?:is|are|was|were|do|does|did|can|could|should|would|will|has|have|had)"
_IMPERATIVE = (
    r"(?:describe|explain|list|summari[sz]e|show(?: me)?|give(?: me)?|find|tell me(?: about)?|name|identify|outline)"
)
# "What is ", "How many ", "Summarize ", optionally after a short lead-in: "For the ingest service, what is "
_HEAD = re.compile(rf"^(?:[^,]{{1,60}}, )?(?:{_QWORD}(?:'s)?(?: {_AUX})? |{_IMPERATIVE} )", re.I)
_CLAUSE_START = re.compile(rf"^(?:{_QWORD}|{_AUX}|{_IMPERATIVE}|compare)\b", re.I)
_BARE_QWORD = re.compile(rf"^{_QWORD}$", re.I)
_LEADING_QWORD = re.compile(rf"^{_QWORD}\b", re.I)
_FILLER = re.compile(r"^(?:(?:also|and|then|plus|please|so)\b,?\s*)+", re.I)
_SEGMENT_END = re.compile(r"(?<=[?;])\s*|(?<=[.!])\s+(?=[A-Z])")
_CONJ = re.compile(r"(,? (?:and also|and|as well as|vs\.?|versus) |, also )", re.I)
_VERSUS = re.compile(r"^,? (?:vs\.?|versus) $", re.I)
_PAIR = re.compile(r" (?:with|to|against) ", re.I)
_ASPECT = re.compile(r"^(?P<body>.+?) (?:in terms of|with respect to|regarding) (?P<aspect>.+)$", re.I)
_COMPARE = re.compile(r"^compare (?P<body>.+)$", re.I)
_HOW_COMPARE = re.compile(r"^how (?:does|do|did) (?P<body>.+?) compare(?: (?:to|with|against) (?P<other>.+))?$", re.I)
_DIFFERENCE = re.compile(
    r"^what(?:'s| is| are| was| were) the differences? (?:in (?P<aspect>.+?) )?between (?P<body>.+)$", re.I
)

# Words after which the rest of a phrase can be shared: "the timeout| of the ingest service",
# "figures| does the report have".
TAIL_STARTERS = frozenset(
    "of for in at on from with during per across under over about does do did is are was were has have had".split()
)
DETERMINERS = frozenset("the a an its their our his her this that these those each every".split())


def _first_tail(phrase: str) -> tuple[int, str] | None:
    """(char index, word) of the first tail starter after the phrase's first word."""
    for m in list(re.finditer(r"\S+", phrase))[1:]:
        if m.group().lower() in TAIL_STARTERS:
            return m.start() - 1, m.group().lower()
    return None


def _last_tail(phrase: str) -> tuple[int, str] | None:
    """(char index just past it, word) of the last tail starter that is followed by something."""
    words = list(re.finditer(r"\S+", phrase))
    for m in reversed(words[1:-1]):
        if m.group().lower() in TAIL_STARTERS:
            return m.end() + 1, m.group().lower()
    return None


def _has_determiner(phrase: str) -> bool:
    return phrase.split()[0].lower() in DETERMINERS


def _distribute(head: str, items: list[str]) -> tuple[list[str], str]:
    """Put ``head`` (and a shared prefix or suffix, when the items' shapes show one) around each item.

    "the revenues of A", "B", "C"  → prefix "the revenues of " is shared;
    "the retry limit", "the timeout of the service" → suffix " of the service" is shared;
    "the revenue of A", "the cost of B" → parallel phrases, nothing is shared.
    Returns the sub-questions and the shared suffix (a later "what is X?" may borrow it).
    """
    if len(items) == 1:
        tail = _first_tail(items[0])
        return [head + items[0]], items[0][tail[0]:] if tail else ""
    first, middle, last = items[0], items[1:-1], items[-1]
    pre_at, suf_at = _last_tail(first), _first_tail(last)
    rest_first = first[pre_at[0]:] if pre_at else first
    core_last = last[: suf_at[0]] if suf_at else last
    cores = [rest_first, *middle, core_last]
    same_shape = len({_has_determiner(c) for c in cores}) == 1 and all(_first_tail(m) is None for m in middle)
    prefix = suffix = ""
    if same_shape and pre_at and suf_at:
        if pre_at[1] != suf_at[1]:  # "revenues of A ... B in 2023"; same word ("of ... of") means parallel phrases
            prefix, suffix = first[: pre_at[0]], last[suf_at[0]:]
    elif same_shape and pre_at:
        prefix = first[: pre_at[0]]
    elif same_shape and suf_at:
        suffix = last[suf_at[0]:]
    if prefix or suffix:
        items = cores
    return [f"{head}{prefix}{item}{suffix}" for item in items], suffix


def _split_list(body: str) -> tuple[list[str], list[str]]:
    """Parts and the separators between them; commas separate only in a list that ends in a conjunction."""
    chunks = _CONJ.split(body)
    parts, seps = [c.strip() for c in chunks[0::2]], chunks[1::2]
    if len(parts) > 1 and ", " in parts[0]:
        pieces = parts[0].split(", ")
        k = len(pieces)
        while k > 1 and len(pieces[k - 1].split()) <= 4 and not _CLAUSE_START.match(pieces[k - 1]):
            k -= 1
        parts = [", ".join(pieces[:k]), *pieces[k:], *parts[1:]]
        seps = [", "] * (len(pieces) - k) + seps
    parts = [_FILLER.sub("", p).strip() for p in parts]
    if any(not p for p in parts):  # "and" at an edge: nothing to split
        return [body], []
    return parts, seps


def _compare_items(text: str) -> tuple[list[str], str] | None:
    """The compared items and the aspect ("" when none) of a comparison, or None."""
    m = _DIFFERENCE.match(text)
    if m:
        return _split_list(m["body"])[0], m["aspect"] or ""
    m = _COMPARE.match(text) or _HOW_COMPARE.match(text)
    if not m:
        return None
    body, aspect = m["body"], ""
    other = m.groupdict().get("other")
    if other:
        body = f"{body} and {other}"
    a = _ASPECT.match(body)
    if a:
        body, aspect = a["body"], a["aspect"]
    items = _split_list(body)[0]
    if len(items) == 1:
        items = [p.strip() for p in _PAIR.split(body)]
    return items, aspect


def _expand_comparison(items: list[str], aspect: str) -> list[str]:
    if len(items) < 2:
        return []
    if aspect:
        article = "" if _has_determiner(aspect) else "the "
        return [f"What is {article}{aspect} of {item}" for item in items]
    return _distribute("What is ", items)[0]


@dataclass(slots=True)
class _Group:
    """One clause of a segment: parts that share a head ("What is" the retry limit, the timeout)."""

    parts: list[str]
    seps: list[str]

    def text(self) -> str:
        out = self.parts[0]
        for sep, part in zip(self.seps, self.parts[1:]):
            out += sep + part
        return out


def _groups(parts: list[str], seps: list[str]) -> list[_Group]:
    groups = [_Group([parts[0]], [])]
    for sep, part in zip(seps, parts[1:]):
        if _CLAUSE_START.match(part):
            groups.append(_Group([part], []))
        else:
            groups[-1].parts.append(part)
            groups[-1].seps.append(sep)
    return groups


def _finish(text: str, mark: str) -> str:
    text = " ".join(text.split()).strip(",;: ")
    text = text[:1].upper() + text[1:]
    if mark != "?" and (_LEADING_QWORD.match(text) or re.match(rf"^{_AUX}\b", text, re.I)):
        mark = "?"
    return text + mark


class RuleDecomposer:
    """Deterministic splitting with simple patterns; no model.

    Splits on "?" and ";" boundaries, on "and", "as well as", "also", "vs", on lists ("A, B and C") under a
    shared predicate, and on comparisons ("compare A and B", "how does A compare to B", "the difference
    between A and B"). Each sub-question repeats the question's head words so that it stands alone.
    Known limits: "and" inside a name ("Research and Development") is split; pronouns ("it") are kept;
    which side of "the revenue of A and the cost" is shared is guessed from the phrases' shapes.
    """

    def __init__(self, *, max_n: int = 4) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {max_n}")
        self.max_n = max_n

    def split(self, question: str) -> list[str]:
        """1 to max_n sub-questions. The question itself when it does not split, or when it would split into
        more than max_n parts (asked whole rather than silently dropping parts)."""
        text = " ".join(question.split())
        if not text:
            raise BadQuestionError(EMPTY_QUESTION)
        pieces = [p for seg in _SEGMENT_END.split(text) if seg.strip() for p in self._split_segment(seg.strip())]
        subs = _dedupe(p for p in pieces if content_words(p))
        if len(pieces) <= 1 or not subs or len(subs) > self.max_n:
            return [text]
        return subs

    def _split_segment(self, segment: str) -> list[str]:
        mark = "?" if segment.endswith("?") else "."
        body = _FILLER.sub("", segment.rstrip("?;.! ")).strip()
        if not body:
            return []
        parts, seps = _split_list(body)
        out: list[str] = []
        pending: list[str] = []  # bare question words: "Where and when was it published?"
        prev: tuple[str, str] | None = None  # (head, shared suffix) of the previous clause
        for group in _groups(parts, seps):
            if len(group.parts) == 1 and _BARE_QWORD.match(group.parts[0]):
                pending.append(group.parts[0])
                continue
            subs, prev = self._expand_group(group, prev)
            for qword in pending:
                out += [_LEADING_QWORD.sub(qword, s, count=1) for s in subs]
            pending = []
            out += subs
        if pending:  # "What is the timeout and why?": no clause to lend "why" to; keep the segment whole
            return [_finish(body, mark)]
        return [_finish(s, mark) for s in out]

    def _expand_group(self, group: _Group, prev: tuple[str, str] | None) -> tuple[list[str], tuple[str, str] | None]:
        text = group.text()
        comparison = _compare_items(" and ".join(group.parts) if len(group.parts) > 1 else text)
        if comparison:
            subs = _expand_comparison(*comparison)
            return (subs or [text]), None
        if " between " in f" {text.lower()} ":  # "the relationship between A and B" is one question
            return [text], None
        head_match = _HEAD.match(group.parts[0])
        if not head_match:
            if len(group.parts) > 1 and all(_VERSUS.match(s) for s in group.seps):  # "Redis vs Qdrant"
                return _expand_comparison(group.parts, ""), None
            return [text], None
        head = head_match.group()
        items = [group.parts[0][len(head):], *group.parts[1:]]
        if not items[0]:
            return [text], None
        if len(items) == 1 and prev and prev[0].lower() == head.lower() and prev[1] and not _first_tail(items[0]):
            # "What is the retry limit of the ingest service, and what is the timeout?": borrow "of the ..."
            return [f"{head}{items[0]}{prev[1]}"], prev
        subs, suffix = _distribute(head, items)
        return subs, (head, suffix)


def _dedupe(subs: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for s in subs:
        if _key(s) not in seen:
            seen.add(_key(s))
            out.append(s)
    return out


# --- the model ---------------------------------------------------------------------------------------------


class ModelDecomposer:
    """Asks the engine for sub-questions as JSON (guided decoding), then validates the reply.

    With a real model this is one more sequential request before retrieval can start, so it is bounded: the
    schema bounds the reply's shape, ``max_tokens`` its length (the engine allows no free whitespace between
    JSON tokens: serving/engine/config.py), and a reply cut short is rejected as truncated, never repaired.
    ``fixed_tokens`` (benchmarks only) makes it decode exactly that many tokens, unguided, standing in for a
    real model's reply where a random-weight model would stop at once: that reply is then rejected (truncated)
    and the rules split the question, so sub-questions stay comparable while the request costs what a real
    one would.
    """

    def __init__(self, engine: Engine, *, max_n: int = 4, max_len: int = 200, max_tokens: int = 160,
                 fixed_tokens: int = 0, cache_salt: str = "") -> None:
        if max_tokens < 1 or fixed_tokens < 0:
            raise ValueError(f"max_tokens must be at least 1 and fixed_tokens at least 0, got {max_tokens} and "
                             f"{fixed_tokens}")
        self.engine = engine
        self.max_n = max_n
        self.max_len = max_len
        self.cache_salt = cache_salt  # the tenant's (mmrag/core/scope.py): its prompts share KV with its own only
        if fixed_tokens:
            self.sampling = SamplingSpec(max_tokens=fixed_tokens, min_tokens=fixed_tokens, temperature=0.0)
        else:
            self.sampling = SamplingSpec(max_tokens=max_tokens, temperature=0.0,
                                         json_schema=json.dumps(sub_question_schema(max_n, max_len)))

    def plan(self, question: str) -> PromptPlan:
        return PromptPlan(images=(), text=question, system_prompt_id="decompose", sampling=self.sampling,
                          cache_salt=self.cache_salt)

    async def propose(self, question: str) -> Completion:
        """The model's raw reply (schema-shaped JSON text when the engine honours guided decoding)."""
        return await self.engine.generate(self.plan(question))

    async def sub_questions(self, question: str) -> list[str]:
        """Validated sub-questions, or RejectedDecomposition. Engine errors propagate: they are not a verdict
        on the model's reply, and hiding them behind the rules would hide an outage."""
        return (await self.decomposition(question))[0]

    async def decomposition(self, question: str) -> tuple[list[str], bool]:
        """:meth:`sub_questions`, and whether the model said the parts need their pages together
        (``"together": true`` in its reply)."""
        completion = await self.propose(question)
        if completion.finish_reason == "length":
            raise RejectedDecomposition(
                Rejection.TRUNCATED,
                f"the reply stopped at max_tokens={self.sampling.max_tokens}: {_excerpt(completion.text)!r}",
            )
        subs = validate_sub_questions(completion.text, question, max_n=self.max_n, max_len=self.max_len)
        return subs, json.loads(completion.text, strict=False).get("together") is True


class Decomposer:
    """Checks the question, splits it by the rules, and asks the model only for a question the rules find
    compound (a single-part question costs no request); the rules' split stands when the model's reply is
    rejected.

    ``engine=None`` uses the rules only (``source="rules"``, ``rejected_reason=None``).
    """

    def __init__(
        self,
        engine: Engine | None,
        *,
        max_n: int = default_of("max_sub_questions"),
        max_len: int = 200,
        max_question_chars: int = MAX_QUESTION_CHARS,
        max_tokens: int = default_of("decompose_max_tokens"),
        fixed_tokens: int = default_of("decompose_fixed_tokens"),
        cache_salt: str = "",
        remember: int = 0,
    ) -> None:
        self.model = (ModelDecomposer(engine, max_n=max_n, max_len=max_len, max_tokens=max_tokens,
                                      fixed_tokens=fixed_tokens, cache_salt=cache_salt)
                      if engine is not None else None)
        self.rules = RuleDecomposer(max_n=max_n)
        self.max_question_chars = max_question_chars
        # The model's decompositions of the last ``remember`` questions (greedy, so the same question gets the
        # same reply): a repeated question, answered from the answer cache, sends no engine request at all.
        self.remember = remember
        self._remembered: OrderedDict[str, Decomposition] = OrderedDict()

    async def decompose(self, question: str) -> Decomposition:
        text = check_question(question, limit=self.max_question_chars)
        ruled = self.rules.split(text)
        if self.model is None or len(ruled) == 1:
            return Decomposition(ruled, "rules", None)
        if (known := self._remembered.get(text)) is not None:
            self._remembered.move_to_end(text)
            return known
        try:
            subs, together = await self.model.decomposition(text)
        except RejectedDecomposition as exc:
            decomposition = Decomposition(ruled, "rules", str(exc))
        else:
            decomposition = Decomposition(subs, "model", None, "the decomposer says its parts need their pages "
                                          "together" if together else None)
        if self.remember:
            self._remembered[text] = decomposition
            while len(self._remembered) > self.remember:
                self._remembered.popitem(last=False)
        return decomposition


# --- llama-index -------------------------------------------------------------------------------------------


class MMRAGQuestionGenerator(BaseQuestionGenerator):
    """llama-index's question generator, backed by :class:`Decomposer`.

    Routing: every sub-question goes to EVERY tool given. The decomposer does not read tool descriptions,
    and sending a sub-question to only the first tool would silently leave the others unasked ("revenue of
    Lyft" sent to an Uber-only tool); with one tool, as in mmrag, that is one query per sub-question.

    Use ``SubQuestionQueryEngine.aquery``: ``generate`` (the sync path ``query`` takes) works only where no
    event loop is running, and only with an engine not bound to another loop (the in-process vLLM engine is
    bound to the loop that started it).
    """

    def __init__(self, decomposer: Decomposer) -> None:
        self.decomposer = decomposer

    def _get_prompts(self) -> PromptDictType:
        return {}  # the system prompt is fixed: SYSTEM_PROMPTS["decompose"] (its KV prefix is shared)

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        own = sorted(k for k in prompts_dict if ":" not in k)
        if own:
            raise ValueError(
                f"MMRAGQuestionGenerator has no prompts to update (got {own}); its system prompt is "
                "SYSTEM_PROMPTS['decompose'] in serving/engine/prompt.py"
            )

    async def agenerate(self, tools: Sequence[ToolMetadata], query: QueryBundle) -> list[SubQuestion]:
        if not tools:
            raise ValueError("no tools to send the sub-questions to: pass at least one query engine tool")
        decomposition = await self.decomposer.decompose(query.query_str)
        return [SubQuestion(sub_question=q, tool_name=t.get_name()) for q in decomposition.sub_questions for t in tools]

    def generate(self, tools: Sequence[ToolMetadata], query: QueryBundle) -> list[SubQuestion]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.agenerate(tools, query))
        raise RuntimeError(
            "MMRAGQuestionGenerator.generate() was called inside a running event loop; it would block it. "
            "Use `await query_engine.aquery(...)` (it calls agenerate) instead of `query_engine.query(...)`"
        )
