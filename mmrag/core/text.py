"""The one text normaliser (page text at ingest, questions at query time).

Everything that turns a PDF text layer, OCR output or a question into the text mmrag embeds, indexes and
matches goes through :func:`normalise`, so the same words always come out the same way. Pure functions: no
I/O, no third-party imports (a word list for ``known`` is the caller's: ``mmrag.adapters.lexical.known_words``).

What pdfium's text layers of real TeX-made manuals (gnuplot.pdf, asymptote.pdf, CAD.pdf) contain, and what is
done with it:

* a line-end hyphen comes out as U+FFFE with the two halves already joined on one line ("ver\\ufffesion",
  "Three\\ufffedimensional"): 210 of them in 531 pages. pdfium emits it for every hyphen at a line end, the
  hyphenation TeX inserted ("portabil-ity") and real compounds that happened to break there
  ("user-defined", "x-value"), so each is decided by :func:`_hyphen_joint`. Other pdfium versions emit U+0002;
  HTML-born PDFs carry U+00AD soft hyphens; all three are the same mark here.
* a plain "-" at a line end followed by a line break (2 in those pages, "1-\\nJan", "CMEX10-\\nBaseline"; OCR
  output has many): the same decision, the next line's first word moved up to the hyphen's line.
* typographic quotes (1,700 U+2019 in gnuplot.pdf, mostly straight quotes of its commands: plot ’data’) and
  U+2212 minus signs: folded to ASCII so a typed question matches them.
* C1 control characters (U+0088, U+0084 where a bullet glyph had no Unicode mapping): removed.
* TeX accents drawn as separate spacing glyphs before their letter ("Moir´e", "Br¨oker", "Mikul´ık"):
  attached and composed ("Moiré", "Bröker", "Mikulík"); "Copyright \rc" (the circle of \copyright as a
  carriage return): "Copyright ©". Found by the samples of tests/data/textlayers.json (other Debian PDFs).
* no ligature code points (U+FB00-FB06) and no dropped ligatures ("de ned"): these text layers decompose fi/fl
  ligatures properly. Both are still handled (NFKC; the repair below), for PDFs that are not so kind.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

Known = Callable[[str], bool]
"""Whether a lowercase word is a real word (a dictionary, plus the page's own words): see normalise."""

# What normalised page text depends on: a change here re-ingests (it is part of every page's fingerprint).
TEXT_VERSION = "norm-v1"

# --- characters ------------------------------------------------------------------------------------------

# The hyphenation mark everything is folded to: pdfium's U+FFFE (or U+0002 in older builds) where a word was
# broken at a line end, and U+00AD soft hyphens. NFKC leaves U+00AD alone.
_MARK = "\u00ad"

_CHAR_MAP: dict[str, str] = {
    "\ufffe": _MARK, "\x02": _MARK, "\u00ad": _MARK,
    # line separators that mean "new line"
    "\u2028": "\n", "\u2029": "\n", "\x85": "\n",
    # spaces (NFKC maps most of them already; these are the ones it does not, plus tabs and form feeds)
    "\t": " ", "\x0b": " ", "\x0c": " ", "\u1680": " ", "\u180e": "",
    # zero-width characters: no word boundary in a PDF text layer
    "\u200b": "", "\u2060": "", "\ufeff": "",
    # ASCII forms of typographic quotes, primes, minus and hyphens, so that typed questions match
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"',
    "\u2212": "-", "\u2010": "-", "\u2011": "-",
    # TeX accents drawn as spacing glyphs before their letter ("Moir´e", "Br¨oker", "J´erˆome"): NFKC makes
    # most of them a space and a combining mark (´ -> " \u0301"); these two it leaves alone, so do it here.
    "\u02c6": " \u0302", "\u02c7": " \u030c",
    "\uffff": "",
}
for _code in [*range(0x00, 0x09), *range(0x0E, 0x20), *range(0x7F, 0xA0)]:  # C0/C1 controls but \t\n\v\f\r
    _CHAR_MAP.setdefault(chr(_code), "")
_SPECIAL = re.compile("[" + "".join(re.escape(c) for c in _CHAR_MAP) + "\u2000-\u200a\u202f\u205f\u3000\u00a0]")


def _fold_char(match: re.Match[str]) -> str:
    return _CHAR_MAP.get(match.group(), " ")  # what is not in the map is a Unicode space


def _fold(text: str) -> str:
    return _SPECIAL.sub(_fold_char, text)


# TeX's \copyright is a "c" in a large circle whose glyph has no Unicode mapping: pdfium gives its character
# code, 13, so "Copyright \rc 2004" (asymptote.pdf p.2, asyRefCard.pdf p.3).
_TEX_COPYRIGHT = re.compile(r"(?<=copyright )\rc(?![a-z])", re.IGNORECASE)

# A combining mark left floating after a space (NFKC's form of a spacing accent) before a letter: the accent
# belongs on that letter. "\u0131" (dotless i, TeX's base for í) takes the accent as a plain i.
_FLOATING_ACCENT = re.compile("((?: [\u0300-\u036f]+)+)([^\W\d_])")


def _attach_accent(match: re.Match[str]) -> str:
    letter = match.group(2)
    return {"\u0131": "i", "\u0237": "j"}.get(letter, letter) + match.group(1).replace(" ", "")


def _attach_accents(text: str) -> str:
    if _FLOATING_ACCENT.search(text) is None:
        return text
    return unicodedata.normalize("NFC", _FLOATING_ACCENT.sub(_attach_accent, text))


# --- hyphens -----------------------------------------------------------------------------------------------

# First halves that make a compound, not a syllable, when no dictionary says otherwise ("self-\nexplanatory",
# "well-\nknown"). Only prefixes TeX's English patterns practically never break an ordinary word after: "pre",
# "re", "multi" ... are not here because "pre-sent" and "multi-ple" are what TeX does to "present", "multiple".
COMPOUND_PREFIXES = frozenset({"self", "well", "ill", "half", "quasi", "pseudo", "cross", "non"})

_LEADING_PUNCT = "([{\"'<"
_WORD_START = re.compile(r"[^\W_]+")


def _hyphen_joint(before: str, after: str, known: Known | None) -> str:
    """"" to join ``before`` and ``after`` as one word broken by hyphenation, "-" to keep a compound.

    ``before`` is the whole token left of the hyphen ("(sub", "one-pixel", "CMEX10"); ``after`` the token right
    of it. The rule, from the 212 line-end hyphens in the real manuals:

    1. not two runs of letters (digits, code: "CMEX10-Baseline", "10-20"), a first half of one letter ("x-value",
       "e-mail"), or a first half that already holds a hyphen ("one-pixel-wide"): keep the hyphen;
    2. the joined word is known ("portability", "defaults" via its stem): join;
    3. a capital after the hyphen: two names ("Marquardt-Levenberg") or a prefix before a name
       ("non-English"): keep; but ALL-CAPS halves are one word TeX broke ("GNU-PLOT"): join;
    4. with a dictionary, two known halves of 4+ letters each are a compound ("user-defined",
       "three-dimensional", "floating-point"): keep; shorter halves are syllables ("de-faults", "sub-scripts"),
       joined. Without one, a first half in COMPOUND_PREFIXES keeps the hyphen;
    5. otherwise join: hyphenation is by far the commonest reason for a hyphen at a line end in typeset text.

    The lexical encoder indexes a hyphenated word whole, in parts and concatenated, so a wrong call costs
    little at search time (mmrag/adapters/lexical.py).
    """
    head = before.lstrip(_LEADING_PUNCT)
    m = _WORD_START.match(after)
    tail = m.group() if m else ""
    if not (head.isalpha() and tail.isalpha()) or len(head) < 2:
        return "-"
    if known is not None and known((head + tail).lower()):
        return ""
    if tail[0].isupper():
        if head.isupper() and tail.isupper():
            return ""
        return "-"
    if known is not None:
        if len(head) >= 4 and len(tail) >= 4 and known(head.lower()) and known(tail.lower()):
            return "-"
        return ""
    return "-" if head.lower() in COMPOUND_PREFIXES else ""


_MARK_RUN = re.compile("\u00ad+ ?")


def _resolve_marks(line: str, known: Known | None) -> str:
    """Hyphenation marks within a line (pdfium has put both halves on it, at most a space between): each
    joint decided left to right, so "hy-phen-ation" is decided as "hy"+"phen", then "hyphen"+"ation"."""
    body = line.rstrip(_MARK)
    tokens = []
    for token in _MARK_RUN.sub(_MARK, body).split(" "):
        if _MARK in token:
            parts = token.split(_MARK)
            token = parts[0]
            for part in parts[1:]:
                token += _hyphen_joint(token, part, known) + part if token and part else part
        tokens.append(token)
    resolved = " ".join(" ".join(tokens).split())
    # A mark at the line's end is left for _dehyphenate, which joins the next line's first word.
    return resolved + _MARK if resolved and len(body) < len(line) else resolved


def _ends_broken(line: str) -> bool:
    """A line that ends in a hyphenation mark, or in a hyphen right after a letter or digit."""
    if line.endswith(_MARK):
        return True
    return len(line) >= 2 and line[-1] == "-" and line[-2].isalnum()


def _dehyphenate(lines: list[str], known: Known | None) -> list[str]:
    out: list[str] = []
    for line in lines:
        while out and line and _ends_broken(out[-1]):
            prev = out[-1]
            mark = prev[-1]
            first, _, rest = line.partition(" ")
            if not first[0].isalnum():  # "foo-" then "(bar)": nothing to glue
                if mark == _MARK:
                    out[-1] = prev.rstrip(_MARK)
                break
            body = prev.rstrip(_MARK) if mark == _MARK else prev[:-1]
            before = body.rpartition(" ")[2]
            out[-1] = body + _hyphen_joint(before, first, known) + first
            line = rest
        if line:
            out.append(line)
    if out and out[-1].endswith(_MARK):
        out[-1] = out[-1].rstrip(_MARK)
    return out


# --- dropped ligatures ------------------------------------------------------------------------------------

LIGATURES = ("ff", "fi", "fl", "ffi", "ffl")
_TOKEN = re.compile(r"^([^\w]*)([^\W\d_]+)([^\w]*)$")


def ligature_repairs(word: str, known: Known) -> list[str]:
    """The known words that ``word`` (lowercase) becomes with one of ff/fi/fl/ffi/ffl inserted somewhere: the
    candidate repairs of a text layer that lost its ligature glyphs ("dened" -> ["defined"]). A repair is made
    only when there is exactly one."""
    found = {word[:i] + lig + word[i:] for i in range(len(word) + 1) for lig in LIGATURES}
    return sorted(w for w in found if known(w))


def _recase(like: str, word: str) -> str:
    if like.isupper() and len(like) > 1:
        return word.upper()
    return word[:1].upper() + word[1:] if like[:1].isupper() else word


# Words that sit next to each other in ordinary text ("so as", "of y"): a gap between them is a word space, not
# a lost ligature, even when a ligature would make a word of them ("sofias", "offly").
_FUNCTION_WORDS = frozenset(
    "a an the and or but nor if so as of to in at by for on off is be it its we he she they this that"
    " with from not no".split()
)
_INTACT = re.compile(r"[^\W\d_]*(?:ff|fi|fl)[^\W\d_]*", re.IGNORECASE)
MIN_LIGATURE_REPAIRS = 2
INTACT_PAGE = 3


def _ligature_proposals(line: str, known: Known) -> list[tuple[int, int, str]]:
    """(first token, tokens replaced, replacement) for the dropped ligatures of one line.

    A gap first ("de ned", "speci ed": the glyph became a space), as two tokens, unless one is a function word
    or the second a single letter (the halves themselves are not asked about: on a damaged page "ect" and
    "cial" are the page's own words); then a single token ("dened", "eld": the glyph vanished, or started
    the word). Letters only; punctuation around the token is kept.
    """
    toks = line.split(" ")
    found: list[tuple[int, int, str]] = []
    i = 0
    while i < len(toks):
        m = _TOKEN.match(toks[i])
        if m is None:
            i += 1
            continue
        pre, word, post = m.groups()
        if not post and i + 1 < len(toks):
            n = _TOKEN.match(toks[i + 1])
            if n is not None and not n.group(1) and n.group(2).islower():
                x, y = word.lower(), n.group(2)
                cands = [c for c in (x + lig + y for lig in LIGATURES) if known(c)]
                ordinary = x in _FUNCTION_WORDS or y in _FUNCTION_WORDS or len(y) == 1
                if len(cands) == 1 and not ordinary and not known(x + y):
                    found.append((i, 2, pre + _recase(word, cands[0]) + n.group(3)))
                    i += 2
                    continue
        low = word.lower()
        if len(word) >= 2 and (word.islower() or word[1:].islower()) and not known(low):
            cands = ligature_repairs(low, known)
            if len(cands) == 1:
                found.append((i, 1, pre + _recase(word, cands[0]) + post))
        i += 1
    return found


def _repair_ligatures(lines: list[str], known: Known) -> list[str]:
    """Restore the ligatures a text layer dropped, when the page shows that it did.

    A text layer that loses ligatures loses them all (the font's ligature glyphs have no Unicode mapping), so
    a damaged page has many candidate repairs and few intact ff/fi/fl words (code in a monospace font, which
    has no ligatures), while an intact page has about 10 intact ones per page and at most a chance candidate
    ("lm", an abbreviation, would be "film"). A page with INTACT_PAGE intact words is left alone without
    looking further (2/3 of the real pages, and what keeps this fast); otherwise repairs are made only when
    there are at least MIN_LIGATURE_REPAIRS of them and more than intact words.
    """
    intact = sum(len(_INTACT.findall(line)) for line in lines)
    if intact >= INTACT_PAGE:
        return lines  # the common case, decided without a dictionary look-up
    proposals = [_ligature_proposals(line, known) for line in lines]
    count = sum(len(p) for p in proposals)
    if count < MIN_LIGATURE_REPAIRS or count <= intact:
        return lines
    out = []
    for line, found in zip(lines, proposals, strict=True):
        if not found:
            out.append(line)
            continue
        toks = line.split(" ")
        for first, width, replacement in reversed(found):
            toks[first : first + width] = [replacement]
        out.append(" ".join(toks))
    return out


# --- the normaliser ---------------------------------------------------------------------------------------


def normalise(text: str, *, known: Known | None = None) -> str:
    """The one normalisation of page text and of questions: what is embedded, indexed and matched.

    * NFKC, so ligature code points (U+FB00-FB06) become their letters (ﬁ -> fi, ﬅ -> st), full-width and
      mathematical letters plain ones; typographic quotes, primes, U+2212 minus and Unicode hyphens become ASCII;
      a TeX accent extracted as a spacing glyph before its letter is put on it ("Moir´e" -> "Moiré");
    * CRLF/CR to LF; NBSP, other Unicode spaces, tabs, vertical tabs and form feeds to a space; runs of spaces
      collapsed, lines stripped, empty lines dropped (line structure is kept: captions start lines);
      control characters (C0 but newline, C1) and zero-width characters removed;
    * hyphenation: pdfium's U+FFFE / U+0002 and U+00AD soft hyphens, and a plain hyphen at a line end, either
      join the two halves into one word or keep a hyphenated compound, by :func:`_hyphen_joint`; a word
      broken over a line end is moved up to the first line;
    * with ``known`` (a lowercase word -> is it a real word), dropped ligatures are restored ("de ned" ->
      "defined") when exactly one ligature insertion gives a known word and the text as it stands is not one,
      on a page that shows it lost its ligatures (:func:`_repair_ligatures`); and ``known`` decides hyphen
      joints first. Without it the output never depends on a dictionary.

    Idempotent for a given ``known``: ``normalise(normalise(x, known=k), known=k) == normalise(x, known=k)``,
    and ``normalise(normalise(x, known=k)) == normalise(x, known=k)`` (what the lexical encoder does to stored
    page text). A 3,000-character page of a real manual takes 0.1-0.2 ms without ``known``; about 1 ms with
    ``mmrag.adapters.lexical.known_words(page)`` built for it (most pages need no dictionary look-up at all).
    """
    if "\r" in text:
        text = _TEX_COPYRIGHT.sub("\u00a9", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _fold(text)
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
        text = _fold(text)  # NFKC makes some of the characters folded above (U+2011 -> U+2010)
        text = _attach_accents(text)
    lines = [" ".join(line.split()) for line in text.split("\n")]
    lines = [line for line in lines if line]
    if _MARK in text:
        lines = [_resolve_marks(line, known) if _MARK in line else line for line in lines]
        lines = [line for line in lines if line]
    if _MARK in text or "-" in text:
        lines = _dehyphenate(lines, known)
    if known is not None:
        lines = _repair_ligatures(lines, known)
    text = "\n".join(lines)
    # Removing a mark or a space can leave an accent floating again: attach it, so a second pass finds none.
    return text if text.isascii() else _attach_accents(text)
