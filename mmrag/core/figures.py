"""Figures' rules, in one home: what a figure region is; how a figure is named, numbered and labelled; which
figures a text names (a page's caption lines, a question's "Figure 3", the sentences a figure point is found by);
which figure a hit names; whether a hit is shown as its figure's crop or as its page; which crops warm-up prefills.

The contract between figure detection at ingest (``ingestion.figures``, which finds regions from a PDF page's
objects and crops them) and everything that stores, finds, shows or cites a figure (a Qdrant payload, the search's
hits, a prompt's images, warm-up, "Figure 3" in an answer). Each rule is written here once and imported by the
rooms that apply it. Pure: no I/O, standard library only; what needs a library (the lexical channel's stemmed
terms) is passed in.

Boxes are in PDF points with a TOP-LEFT origin and y growing down, so a page rendered at ``scale`` pixels per
point maps a box to pixels by one multiplication (:meth:`FigureRegion.bbox_px`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from mmrag.core.keys import ImageKey

if TYPE_CHECKING:
    from mmrag.core.payload import PagePayload  # which imports this module


# --- regions, names and labels ----------------------------------------------------------------------------

Box = tuple[float, float, float, float]
"""x0, y0, x1, y1 in points, top-left origin, y down; x0 <= x1 and y0 <= y1."""

FigureKind = Literal["figure", "table", "image", "slide"]
FigureSource = Literal["raster", "vector", "form", "page"]

KINDS: frozenset[str] = frozenset({"figure", "table", "image", "slide"})
SOURCES: frozenset[str] = frozenset({"raster", "vector", "form", "page"})


@dataclass(frozen=True, slots=True)
class FigureRegion:
    """One figure on a page.

    ``number`` is the N of its caption ("Figure 3:", "Fig. 3.", "Table 3") when that is a whole number, else
    None (uncaptioned, or numbered "3.2"/"A.1": the caption text still carries it). ``kind`` is "figure",
    "table", "image" (an uncaptioned raster) or "slide". ``source`` says what the box was found from: a raster
    image object, a cluster of vector paths, a form XObject, or the page itself.
    """

    number: int | None
    kind: FigureKind
    caption: str
    bbox_pt: Box
    source: FigureSource

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, not {self.kind!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {sorted(SOURCES)}, not {self.source!r}")
        x0, y0, x1, y1 = self.bbox_pt
        if not (x0 <= x1 and y0 <= y1) or not all(math.isfinite(v) for v in self.bbox_pt):
            raise ValueError(f"bbox_pt must be finite (x0, y0, x1, y1) with x0 <= x1 and y0 <= y1, not {self.bbox_pt}")

    @property
    def ref(self) -> tuple[str, str] | None:
        """How a question names it, as :func:`figure_refs` gives it: ("figure" | "table", "3"); None without a
        whole number."""
        if self.number is None:
            return None
        return ref_kind(self.kind), str(self.number)

    def named_by(self, ref: tuple[str, str]) -> bool:
        """Whether a question's reference (:func:`figure_refs`: ("figure", "3")) names this figure: by its
        kind (a table, or any other kind as a figure) and whole number, or as its caption prints it ("Table IV",
        "Figure 3.2", "Listing 2"), a panel of it included ("Figure 3a", "Figure 3B", "Figure 3.2a")."""
        kind, number = ref
        own = set()
        if self.number is not None and kind == ref_kind(self.kind):
            own.add(str(self.number))
        printed = caption_label(self.caption)
        if printed is not None and printed[0] == kind:
            own.add(printed[1].upper())
        panel = re.fullmatch(r"(\d[\d.]*)[a-z]", number, re.IGNORECASE)
        return number.upper() in own or (panel is not None and panel.group(1) in own)

    def bbox_px(self, scale: float, size: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
        """The box on the page rendered at ``scale`` pixels per point: outward-rounded ints, clamped at 0 and,
        given the rendered image's ``size`` (width, height), at its edges."""
        x0, y0, x1, y1 = self.bbox_pt
        box = [math.floor(x0 * scale), math.floor(y0 * scale), math.ceil(x1 * scale), math.ceil(y1 * scale)]
        box = [max(0, v) for v in box]
        if size is not None:
            w, h = size
            box = [min(box[0], w), min(box[1], h), min(box[2], w), min(box[3], h)]
        return box[0], box[1], box[2], box[3]

    def to_json(self) -> dict[str, Any]:
        """A plain dict for a payload (lists, str, int, None)."""
        data = asdict(self)
        data["bbox_pt"] = [round(v, 2) for v in self.bbox_pt]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FigureRegion:
        x0, y0, x1, y1 = (float(v) for v in data["bbox_pt"])
        return cls(
            number=None if data.get("number") is None else int(data["number"]),
            kind=data["kind"],
            caption=data.get("caption", ""),
            bbox_pt=(x0, y0, x1, y1),
            source=data["source"],
        )


def ref_kind(kind: str) -> str:
    """The word a figure of ``kind`` is named by, in a question and in a label: "table" for a table, "figure" for
    any other kind (an uncaptioned picture too)."""
    return "table" if kind == "table" else "figure"


def region_name(caption_kind: str, caption_number: str | None, source: str) -> tuple[FigureKind, int | None]:
    """A detected region's kind and number, from the caption that names it (its kind and number as
    :func:`captions` gives them; "" and None for none) and what it was found from (FigureSource): a figure or
    table caption gives its kind, a listing's a figure; uncaptioned, a raster picture is an "image" and anything
    else a "figure". The number only when it is whole ("3"; not "3.2", "A.1" or "IV", which the caption keeps)."""
    if caption_kind in ("figure", "table"):
        kind = caption_kind
    elif caption_kind == "listing":
        kind = "figure"
    else:
        kind = "image" if source == "raster" else "figure"
    number = int(caption_number) if caption_number is not None and re.fullmatch(r"\d+", caption_number) else None
    return kind, number  # type: ignore[return-value]


def figure_label(kind: str, number: int | None) -> str:
    """"Figure 3", "Table 2"; "a figure" ("a table") without a whole number."""
    word = ref_kind(kind)
    return f"a {word}" if number is None else f"{word.title()} {number}"


def figure_reference(kind: str, number: int | None, caption: str) -> str:
    """How a footnote or `mmrag ask` names a figure: its label and its caption without the "Figure 3:" / "Fig. 3."
    the caption starts with ("Figure 3: Revenue by quarter"); a caption that names it otherwise ("Figure 3.2 ...",
    "TABLE IV ...") as printed; the label alone without a caption."""
    caption = " ".join(caption.split())
    if not caption:
        return figure_label(kind, number)
    if number is None:
        return caption
    parsed = caption_label(caption)
    if parsed is None or parsed[1] != str(number):
        return caption
    return f"{figure_label(kind, number)}: {parsed[2]}" if parsed[2] else figure_label(kind, number)


def area(box: Box) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def intersection(a: Box, b: Box) -> float:
    return area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))


def iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes; 0.0 when both are empty."""
    inter = intersection(a, b)
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


def union_box(a: Box, b: Box) -> Box:
    return min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])


@dataclass(frozen=True, slots=True)
class PageFigure:
    """A figure of an indexed page: its region, and the image entry of its crop (its own key, content-addressed
    like a page's: the same figure in two documents is one key, one vision forward, one KV prefix)."""

    region: FigureRegion
    image_key: ImageKey
    image_tokens: int

    @property
    def label(self) -> str:
        """How an answer names it: "Figure 3", "Table 2", or "a figure" when uncaptioned."""
        return figure_label(self.region.kind, self.region.number)

    def to_json(self) -> dict[str, Any]:
        return {**self.region.to_json(), "image_key": str(self.image_key), "image_tokens": self.image_tokens}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PageFigure:
        return cls(FigureRegion.from_json(data), ImageKey.parse(data["image_key"]), int(data["image_tokens"]))

    def citation(self) -> dict[str, Any]:
        """What a citation says of it (REST ``figure``): number, caption, kind and box in points (top-left
        origin) on the page."""
        return {"number": self.region.number, "kind": self.region.kind, "caption": self.region.caption,
                "bbox": [round(v, 1) for v in self.region.bbox_pt]}


# --- captions: how a figure is numbered, and which figures a text names -----------------------------------

CaptionKind = Literal["figure", "table", "listing", "title"]


@dataclass(frozen=True, slots=True)
class Caption:
    """A caption line of a page (or a slide's title): what a question naming "Figure 12" should find."""

    kind: CaptionKind
    number: str | None  # "12", "3.2", "A.1", "IV"; None for a title
    text: str  # the caption as it reads on the page, normalised (continuation lines included)


_KIND_WORDS = {
    "figure": "figure", "figures": "figure", "fig": "figure", "figs": "figure",
    "table": "table", "tables": "table", "tab": "table",
    "listing": "listing", "listings": "listing",
}
# A caption number: 12, 3.2, 12a, A.1, S3, 2-1; or an upper-case Roman numeral (IEEE tables: TABLE IV).
_NUMBER = r"(?:[A-Z]\.?)?\d+(?:[.\-]\d+)*[a-z]?|[IVXL]+"
# At the start of a line, capitalised or upper-case as captions are written ("figure 1," in a sentence that
# begins a line is a reference); after the number a separator, the end of the line, or a capital/quote/bracket
# starting the caption text ("Fig. 3 Results of ..."); never a lowercase word ("Figure 3 shows ...").
_CAPTION = re.compile(
    rf"^(?P<word>Figure|FIGURE|Fig\.?|FIG\.?|Table|TABLE|Tab\.|TAB\.|Listing|LISTING)\s*(?P<num>{_NUMBER})"
    r"(?:\s*[:.|\u2013\u2014-](?!\d)|\s*$|\s+(?=[\"'(\[A-Z0-9]))"
)
# A caption does not continue a sentence: the line before it does not end in one of these.
_REFERRING = frozenset(
    "see in of to and or from shown cf cf. per with by on at under e.g. i.e. the as like also is are was were "
    "than into below above for a an this that which".split()
)
_ROMAN = r"(?=[ivxlcdm])m{0,3}(?:cm|cd|d?c{0,3})(?:xc|xl|l?x{0,3})(?:ix|iv|v?i{0,3})"  # a well-formed one
# What is on a slide before its title: a page number ("12", "- 4 -", "iv", "Page 3 of 10", "Slide 3 / 20"),
# punctuation, a copyright line.
_PAGE_FURNITURE = re.compile(
    rf"^\W*(?:page\s*|slide\s*)?(?:\d+|{_ROMAN})(?:\s*(?:/|of)\s*\d+)?\W*$"
    r"|^\W*$|^(?:©|\(c\)|copyright\b)",
    re.IGNORECASE,
)
_SENTENCE_END = ".:;!?"
_MAX_CONTINUATION = 3


def _number(raw: str) -> str:
    return raw.rstrip(".").upper() if raw[:1].isalpha() and not _is_roman(raw) else raw.rstrip(".")


def _is_roman(raw: str) -> bool:
    return bool(re.fullmatch(r"[IVXL]+", raw))


def captions(text: str, *, slide: bool = False) -> list[Caption]:
    """The caption lines of a page's (normalised) text: "Figure 12: ...", "Fig. 3 ...", "FIGURE 3 ...",
    "Table 2: ...", "TABLE IV ...", "Listing 1 ...", each starting a line. A caption whose line ends without
    punctuation takes up to 3 following lines that start lowercase (the rest of a wrapped caption).

    References are not captions: "see Figure 12" (not at a line start), "figure 1, use this code"
    (lowercase), "Figure 3 shows ..." (a lowercase word after the number), or a line after one ending in
    "see", "in", "of" ... (a sentence carrying on). With ``slide`` (the caller's call: a landscape page with
    little text), the first line that is not a page number, a footer or punctuation is a ``title`` caption,
    listed first.
    """
    lines = text.split("\n")
    found: list[Caption] = []
    if slide:
        for line in lines:
            line = line.strip()
            if line and not _PAGE_FURNITURE.match(line):
                found.append(Caption("title", None, line))
                break
    for i, line in enumerate(lines):
        m = _CAPTION.match(line)
        if m is None:
            continue
        if i > 0:
            last = lines[i - 1].rstrip().rpartition(" ")[2].lower()
            if last in _REFERRING:
                continue
        kind = _KIND_WORDS[m.group("word").rstrip(".").lower()]
        num = m.group("num")
        if _is_roman(num) and kind != "table":  # Roman numerals number tables, and are words elsewhere
            continue
        caption = line.strip()
        for nxt in lines[i + 1 : i + 1 + _MAX_CONTINUATION]:
            if caption[-1:] in _SENTENCE_END or not nxt[:1].islower():
                break
            caption += " " + nxt.strip()
        found.append(Caption(kind, _number(num), caption))  # type: ignore[arg-type]
    return found


def caption_label(caption: str) -> tuple[str, str, str] | None:
    """A caption line's label and the rest: "Fig. 3. Revenue" -> ("figure", "3", "Revenue"), numbers as
    :func:`captions` gives them; None for a line that does not start with a caption label."""
    m = _CAPTION.match(caption.strip())
    if m is None:
        return None
    return _KIND_WORDS[m.group("word").rstrip(".").lower()], _number(m.group("num")), caption.strip()[m.end():].strip()


_REF = re.compile(
    rf"\b(?P<word>figures?|figs?\.?|tables?|tab\.|listings?)\s*(?P<nums>(?:{_NUMBER})(?!\w)"
    rf"(?:\s*(?:,|and|or|&|\u2013|-|to)\s*(?:{_NUMBER})(?!\w))*)",
    re.IGNORECASE,
)
_REF_NUM = re.compile(rf"({_NUMBER})(?!\w)(?:\s*(?:\u2013|-|to)\s*({_NUMBER})(?!\w))?", re.IGNORECASE)
_MAX_RANGE = 20


def starts_with_reference(line: str) -> bool:
    """Whether ``line`` opens with a figure, table or listing reference that :func:`figure_refs` accepts ("Figure
    3: ...", "TABLE IV costs", "Fig. 2 shows ..."), as every caption line does and a slide's title does not."""
    opening = _REF.match(line.strip())
    return opening is not None and bool(figure_refs(opening.group(0)))


def figure_refs(text: str) -> list[tuple[str, str]]:
    """(kind, number) for each figure/table/listing a question names, in order, once each:
    "Figure 12", "fig. 3.2", "Table A.1", "Figure 2-1", "Figures 3 and 4", "Figs. 2-4" (after a plural, a
    range, of up to 20 spelled out),
    "table IV" (Roman numerals for tables, written upper-case). Numbers come out as :func:`captions` gives them.
    """
    refs: list[tuple[str, str]] = []
    for m in _REF.finditer(text):
        word = m.group("word").rstrip(".").lower()
        kind = _KIND_WORDS[word]
        plural = word.endswith("s")
        for n in _REF_NUM.finditer(m.group("nums")):
            first, last = n.group(1), n.group(2)
            dashed = re.fullmatch(r"(\d+)-(\d+)", first)
            if plural and dashed and last is None:  # "Figs. 2-4" is a range, "Figure 2-4" a number
                first, last = dashed.groups()
            nums = [first]
            if last and first.isdigit() and last.isdigit() and 0 < int(last) - int(first) <= _MAX_RANGE:
                nums = [str(k) for k in range(int(first), int(last) + 1)]
            elif last:
                nums.append(last)
            for num in nums:
                if _is_roman(num.upper()) and not num.isupper():
                    continue  # "table i" is not Table I
                if _is_roman(num) and kind != "table":
                    continue
                ref = (kind, _number(num))
                if ref not in refs:
                    refs.append(ref)
    return refs


# --- what a figure point is found by ----------------------------------------------------------------------

FIGURE_TEXT_CHARS = 1200  # MiniLM reads ~256 word pieces: the caption, its words, the first sentences naming it
FIGURE_WORDS_CHARS = 400  # of the words drawn inside a figure: its labels, not a whole table's body
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")


def figure_words(text: str, caption: str = "") -> str:
    """The words drawn inside a figure (tick and axis labels, a legend, node names: a PDF's text objects in its
    region, or a raster's OCR) as its point keeps them: whitespace collapsed, its caption's words left out, tokens
    without a letter dropped (a plot's tick values "0 10 20" name nothing a question asks for), at most
    FIGURE_WORDS_CHARS."""
    text = " ".join(text.split())
    if caption:
        text = text.replace(" ".join(caption.split()), " ")
    kept = " ".join(w for w in text.split() if any(c.isalpha() for c in w))
    return kept[:FIGURE_WORDS_CHARS].rsplit(" ", 1)[0] if len(kept) > FIGURE_WORDS_CHARS else kept


def figure_mentions(pages: Iterable[tuple[int, str]]) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """Every sentence of a document that names a figure or table by number (:func:`figure_refs`), under each
    reference it names, with its page, in page order: ``pages`` as (page number, page text). Read once a
    document, so each figure point finds the sentences naming it anywhere in it (:func:`figure_text`)."""
    mentions: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for number, text in pages:
        for sentence in _SENTENCE.split(" ".join(text.split())):
            sentence = sentence.strip()
            for ref in figure_refs(sentence) if sentence else ():
                mentions.setdefault(ref, []).append((number, sentence))
    return mentions


def figure_text(region: FigureRegion, page_text: str, *, words: str = "",
                elsewhere: Sequence[str] = ()) -> str:
    """What a figure point is found by (the figure channel): its caption; the words drawn inside it
    (:func:`figure_words`); the sentences of its page that name it by number ("as Figure 3 shows ..."); then
    ``elsewhere``, the sentences of the document's other pages that name it (:func:`figure_mentions`), each once,
    cut at FIGURE_TEXT_CHARS. Empty for a figure with none of these (it is found through its page, or its pixels).
    Ingestion stores it: a change re-ingests (ingestion/figures.py FIGURES_VERSION)."""
    parts = [region.caption] if region.caption else []
    if words:
        parts.append(words)
    if region.ref is not None:
        own = [s for _, s in figure_mentions([(0, page_text)]).get(region.ref, [])]
        for sentence in [*own, *elsewhere]:
            if sentence not in region.caption and sentence not in parts:
                parts.append(sentence)
    return " ".join(parts)[:FIGURE_TEXT_CHARS]


# --- which figure a hit names ------------------------------------------------------------------------------

Terms = Callable[[str], Iterable[str]]
"""A text's terms, by which a question matches a caption or a slide's title: the lexical channel's tokens
(mmrag/adapters/lexical.py LexicalEncoder.tokens: normalised, stemmed, stop words out), passed in by the caller
as normalise's ``known`` is (the contracts stem nothing). Retrieval naming a hit's figure and warm-up choosing the
crops a hit can name must pass the same."""

# A caption matches a query that shares at least this share of the caption's terms, and two of them at least.
CAPTION_MATCH_SHARE = 0.5

# The figure channel names a page's figure (Hit.figure) only when the figure point's text is this close to the
# query (MiniLM cosine): the channel always returns its nearest figures, and a page it helped rank for an
# unrelated question ("how long are backups retained?") must not be cited as that figure.
FIGURE_NAMING_MIN_SIMILARITY = 0.5


def slide_title(captions: Sequence[str]) -> str:
    """A slide's title among a page's caption lines (ingestion finds one on a slide only: a landscape page of
    few words; the payload keeps caption lines as text only): the line that opens with no figure, table or
    listing reference; empty when there is none."""
    return next((c for c in captions if not starts_with_reference(c)), "")


def _lone_uncaptioned(figures: Sequence[PageFigure]) -> bool:
    """A page's only figure, without a caption: on a slide, what the slide's title is about."""
    return len(figures) == 1 and not figures[0].region.caption


def named_figures(page: PagePayload, *, terms: Terms) -> list[PageFigure]:
    """The page's figures a question's words can name (:func:`hit_figure`): by a number, by a caption, or, a
    slide's lone uncaptioned figure, by the slide's title (of two terms at least, as a match needs two). The
    others are found only by their pixels (a page-image channel's figure points)."""
    if _lone_uncaptioned(page.figures):
        title = slide_title(page.captions)
        return list(page.figures) if len(set(terms(title))) >= 2 else []
    return [f for f in page.figures if f.region.number is not None or f.region.caption]


def hit_figure(figures: Sequence[PageFigure], query: str, *, terms: Terms, title: str = "",
               found: int | None = None) -> PageFigure | None:
    """Which of a retrieved page's figures the query is about: the one it names by number ("Figure 3",
    "Table 2", "Figure 3a"; :func:`figure_refs`, FigureRegion.named_by), else the one whose caption terms
    (without its "Figure N:" label) the query shares most of, at least CAPTION_MATCH_SHARE of them and two, else
    the one a channel ``found`` the page by (its index in ``figures``: the figure channel's point, a page-image
    channel's crop); None when none holds. A slide's lone uncaptioned figure (a chart pasted on a slide) is what
    the slide's ``title`` says, and matches by the title's terms."""
    if not figures:
        return None
    named = figure_refs(query)
    for figure in figures:
        if any(figure.region.named_by(ref) for ref in named):
            return figure
    asked = set(terms(query))
    lone = _lone_uncaptioned(figures)
    best, best_share = None, 0.0
    for figure in figures:
        caption = title if lone else figure.region.caption
        parsed = caption_label(caption)
        words = set(terms(parsed[2] if parsed else caption))
        shared = len(asked & words)
        if words and shared >= 2 and shared / len(words) > best_share:
            best, best_share = figure, shared / len(words)
    if best_share >= CAPTION_MATCH_SHARE:
        return best
    return figures[found] if found is not None and 0 <= found < len(figures) else None


# --- shown as its crop or as its page ----------------------------------------------------------------------

# Words by which a question asks for what a page SAYS, not what its figure shows: the page is shown then. Whole
# words only ("cross-section" is not "section").
_PAGE_WORDS = re.compile(r"(?<![\w-])(?:text|texts|paragraphs?|sections?|passages?|surrounding|according|why|"
                         r"explain\w*|discuss\w*|mention\w*|say|says|said|conclu\w*)(?![\w-])", re.IGNORECASE)


def needs_page(question: str, figure: PageFigure, *, whole: str = "") -> str | None:
    """Why ``question`` needs more than ``figure``'s crop (None when the crop is enough): it, or the ``whole``
    question it was split from, asks what the page says around the figure (its words: "according to the text",
    "why", "explain", "what does the section conclude"; _PAGE_WORDS), or it names another figure or table than
    this one ("is Figure 2 like Table 3?"), which the page may show beside it. A rule over the question's words,
    so it errs on the page's side: a question the crop would answer but that uses one of those words costs the
    page's tokens, never an answer."""
    for text in (question, whole):
        if word := _PAGE_WORDS.search(text):
            return f"it asks what the page says ({word.group(0)!r})"
    others = [ref for ref in figure_refs(question) if not figure.region.named_by(ref)]
    if others:
        kind, number = others[0]
        return f"it names {kind} {number} too"
    return None


def shown_as_crop(question: str, figure: PageFigure | None, *, whole: str = "") -> bool:
    """Whether a hit on ``figure`` (None: on no figure) that ``question`` found is shown as the figure's crop
    (MMRAG_FIGURE_CROPS; rag/plans.py shown_as_figures): unless the question needs more (:func:`needs_page`),
    when it stays its page, the figure still named in its citation."""
    return figure is not None and needs_page(question, figure, whole=whole) is None


def shows_crop(image_key: ImageKey, figure: PageFigure | None) -> bool:
    """Whether the image ``image_key`` names (a hit's, in any tier) is ``figure``'s crop, not its page: the same
    content."""
    return figure is not None and image_key.content_hash == figure.image_key.content_hash


# --- which crops warm-up prefills --------------------------------------------------------------------------


def leading_crops(page: PagePayload, *, by_pixels: bool, terms: Terms) -> list[PageFigure]:
    """The page's figures whose crops a prompt can lead with when a hit on a figure is shown as its crop
    (MMRAG_FIGURE_CROPS): those a hit can name, by a question's words (:func:`named_figures`: a number, a
    caption, a slide's title) and, with a page-image channel finding crops by their pixels (``by_pixels``:
    Settings.page_image_channel), every one. Another figure is never a hit's, so its crop is never shown, however
    many pages show it."""
    return list(page.figures) if by_pixels else named_figures(page, terms=terms)
