"""mmrag.core.text, the one normaliser, and mmrag.core.figures' caption extraction and figure references, on real PDF
text layers.

The raw strings marked with a document and page are pypdfium2 ``get_textpage().get_text_range()`` of the
Debian gnuplot and asymptote manuals (gnuplot.pdf, asymptote.pdf, CAD.pdf), copied verbatim: pdfium's U+FFFE
hyphenation marks, CRLF line ends, curly quotes, U+2212 minus and the U+0088 of a bullet without a Unicode
mapping are what those text layers hold. None of those PDFs has ligature code points or dropped ligatures, so
those cases are constructed strings (said so where they are).
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

from mmrag.adapters.lexical import is_english_word, known_words
from mmrag.core.figures import Caption, captions, figure_refs
from mmrag.core.text import normalise
from ingestion.loaders import normalise_text

# --- real samples ---------------------------------------------------------------------------------------

# CAD.pdf p.5: pdfium has joined the two lines of "free-|hand" and marked the joint with U+FFFE.
CAD_P5 = (
    "To draw a line between two points, which is not straight, but more like a free\ufffehand line, use this "
    "function. The pairs pFrom and pTo denote start and end\r\npoint, respectively. dblRelDivisionLength is the "
    "length of the parts, the line\r\nis subdivided into.\r\nconverting a guide containing more than two points "
    "to a freehand line.\r\n4 Example\r\nTo produce figure 1, use this code:\r\n5"
)
# CAD.pdf p.6: the page of Figure 1, its caption wrapped over two lines.
CAD_P6 = (
    "\u221a\r\n2\r\n1 0.5 0.5\r\nFigure 1: Example showing the measurement capabilities and a small freehand\r\n"
    "line.\r\nimport CAD;\r\nsCAD cad = sCAD.Create();\r\n// Freehand line\r\ndraw(g = "
    "cad.MakeFreehand(pFrom = (3, -1)*cm, (6, -1)*cm),\r\np = cad.pFreehand);"
)
# CAD.pdf p.2: U+0088 where the itemize bullet was.
CAD_P2 = "t important pens. Available\r\npens are:\r\n\x88 The pens of group A:\r\n\u2013 pA\r\n\u2013 pVisibleEdge"
ASY_P6 = ("compilation of figures into virtual machine code for speed, without sacrificing portabil\ufffeity;\r\n"
          "\u2022 the power of a script-based language coupled to the convenience")
ASY_P90 = ("and inline. keyval-style options to the asy and asyinclude environments. Three\ufffedimensional PRC "
           "files may either be embedded within the page (the default)")
ASY_P27 = "precontrol point c1, is computed as the Bezier curve\r\n(1 \u2212 t)\r\n3\r\nz0 + 3t(1 \u2212 t)"
GNUPLOT_P22 = 'set title "My First Plot"; plot \u2019data\u2019; print "all done!"\r\nCommands may extend over sev'
GNUPLOT_P29 = ("stored internally as the number of seconds relative to the standard unix epoch 1-\r\nJan-1970. "
               "Earlier versions of gnuplot used a different epoch internally")
GNUPLOT_P34 = ("column headings is automated by set datafile columnheaders or set key autotitle column\ufffehead. "
               "See labels (p. 76), using xticlabels (p. 118), plot title (p. 124),")
GNUPLOT_P36 = ("l uses its own font search path. It is controlled by the environmental variable GNU\ufffePLOT "
               "FONTPATH.\r\nGNUPLOT PS DIR is used by the postscript driver to search fo")
GNUPLOT_P113 = ("the smooth cumulative option makes the data monotonic in x; points with the same x\ufffevalue are "
                "replaced by a single point containing the cumulative sum of y-values")
GNUPLOT_P165 = ('filename are displayed as usual for hypertext. Example:\r\nset label 7 "image:../figures/'
                'Fig7_inset.png\\nFigure 7 caption..."\r\nset label 7 at 10,100 hypertext point ')
GNUPLOT_P280 = ('gnuplot defines the additional font "CMEX10-\r\nBaseline". It is shifted vertically in order to fit '
                'better to the other')
# Real text that a careless ligature repair would change ("so as" -> "sofias", "of y" -> "offly", "lm" -> "film",
# "lly" -> "filly", "sed" -> "fised"): gnuplot.pdf pp. 57, 62, 161, 59 and asymptote.pdf p. 25.
INTACT = [
    "although probably should be avoided so as not to cause confusion:\r\nplot = \"my_datafile.dat\"",
    "expects either a single column of y values (with implicit x ordering) or a pair of columns with x in the "
    "first\r\nand y in the second",
    "lmargin (lm), rmargin (rm), tmargin (tm), and bmargin (bm) is combined with a single, non-conflicting",
    "list of op\ufffetional bounding box (bb=llx lly urx ury), width (width=value), height (height=value),",
    'lines = \u2018 wc --lines @filename | sed "s/ .*//" \u2018\r\nresults in the number of lines in mydata.inp',
]
# Real text-layer artefacts of more Debian PDFs (gnuplot, asymptote, r-cran-sandwich, r-cran-vcd, impressive),
# collected with the page and what the words must come out as: {doc, page, raw, note, expect_words}.
TEXTLAYERS = json.loads((Path(__file__).parent / "data" / "textlayers.json").read_text(encoding="utf-8"))

REAL = [CAD_P5, CAD_P6, CAD_P2, ASY_P6, ASY_P90, ASY_P27, GNUPLOT_P22, GNUPLOT_P29, GNUPLOT_P34, GNUPLOT_P36,
        GNUPLOT_P113, GNUPLOT_P165, GNUPLOT_P280, *INTACT]


def lines_of(text: str) -> list[str]:
    return text.split("\n")


# --- pdfium's hyphenation marks ---------------------------------------------------------------------------


@pytest.mark.parametrize("raw, word", [
    (ASY_P6, "portability;"),  # TeX's hyphenation, no dictionary needed
    (CAD_P5, "freehand"),
    (GNUPLOT_P36, "GNUPLOT"),  # ALL-CAPS halves: one word TeX broke
    (GNUPLOT_P113, "x-value"),  # a one-letter first half is a compound
])
def test_pdfium_hyphenation_marks_are_resolved_without_a_dictionary(raw, word):
    out = normalise(raw)
    assert "\ufffe" not in out and "\u00ad" not in out
    assert word in out.split()


def test_a_compound_broken_at_the_line_end_keeps_its_hyphen_when_both_halves_are_words():
    # asymptote.pdf p.90: "Three-dimensional"; without a dictionary the joint is read as hyphenation.
    assert "Three-dimensional" in normalise(ASY_P90, known=known_words(ASY_P90)).split()
    assert "Threedimensional" in normalise(ASY_P90).split()


def test_the_pages_own_words_decide_a_joint_the_dictionary_cannot():
    # "columnhead" is in no dictionary, but the page says "columnheaders"; "freehand" is on the page.
    assert "columnhead." in normalise(GNUPLOT_P34, known=known_words(GNUPLOT_P34)).split()
    assert "freehand" in normalise(CAD_P5, known=known_words(CAD_P5)).split()
    assert not is_english_word("columnhead")


@pytest.mark.parametrize("mark", ["\ufffe", "\x02", "\u00ad"])
def test_every_hyphenation_mark_joins_a_word_over_a_line_end(mark):
    # Older pdfium builds emit U+0002, and some put the line break after the mark: the next line's first
    # word moves up, the line structure is otherwise kept.
    assert normalise(f"without sacrificing portabil{mark}\r\nity; the power\nof it") == (
        "without sacrificing portability;\nthe power\nof it")
    assert normalise(f"soft hy{mark}phen{mark}ation") == "soft hyphenation"


def test_plain_line_end_hyphens():
    assert "1-Jan-1970." in normalise(GNUPLOT_P29).split()  # gnuplot.pdf p.29: a date, not hyphenation
    assert '"CMEX10-Baseline".' in normalise(GNUPLOT_P280).split()  # gnuplot.pdf p.280: a font name
    assert normalise("a hyphen-\nated word") == "a hyphenated\nword"  # OCR output looks like this
    assert normalise("a well-\nknown fact") == "a well-known\nfact"  # a compound prefix
    assert normalise("the x-\naxis label") == "the x-axis\nlabel"
    assert normalise("see -\nthis") == "see -\nthis"  # a dash, not a hyphen
    assert normalise("foo-\n(bar)") == "foo-\n(bar)"
    assert normalise("inter-\nactively shown", known=is_english_word) == "interactively\nshown"
    assert normalise("user-\ndefined value", known=is_english_word) == "user-defined\nvalue"
    assert normalise("the command-line options") == "the command-line options"  # one line: untouched


def test_a_chain_of_broken_lines_is_followed():
    assert normalise("re-\nhyphen-\nated end") == "rehyphenated\nend"


@pytest.mark.parametrize("sample", TEXTLAYERS, ids=[f"{t['doc']}-p{t['page']}" for t in TEXTLAYERS])
@pytest.mark.parametrize("dictionary", [False, True])
def test_real_text_layer_artefacts_come_out_as_words(sample, dictionary):
    known = known_words(sample["raw"]) if dictionary else None
    out = normalise(sample["raw"], known=known)
    for word in sample["expect_words"]:
        assert re.search(rf"(?<!\w){re.escape(word)}(?!\w)", out), (word, sample["note"], out)
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\ufffe\u00ad]", out)
    assert normalise(out, known=known) == out and normalise(out) == out


def test_tex_accents_and_the_copyright_circle():
    assert normalise("Br\u00a8oker, J\u00b4er\u02c6ome, Mikul\u00b4\u0131k, Moir\u00b4e") == (
        "Br\u00f6ker, J\u00e9r\u00f4me, Mikul\u00edk, Moir\u00e9")
    assert normalise("Copyright \rc 2004-23 Andy Hammerlindl") == "Copyright \u00a9 2004-23 Andy Hammerlindl"


# --- characters -------------------------------------------------------------------------------------------


def test_ligature_code_points_become_letters():
    # Constructed: none of the Debian PDFs has a ligature code point (pdfium decomposes their fi/fl glyphs).
    assert normalise("\ufb01le \ufb02ow e\ufb00ect o\ufb03ce ba\ufb04e \ufb05 \ufb06") == (
        "file flow effect office baffle st st")


def test_quotes_minus_and_controls_are_folded_the_way_a_question_is_typed():
    assert "plot 'data';" in normalise(GNUPLOT_P22)  # gnuplot.pdf p.22: curly quotes around a file name
    assert "(1 - t)" in lines_of(normalise(ASY_P27))  # asymptote.pdf p.27: U+2212
    assert lines_of(normalise(CAD_P2))[2] == "The pens of group A:"  # CAD.pdf p.2: U+0088 removed
    assert normalise("\u201cquoted\u201d \u2018x\u2019 10\u2032 a\u2011b") == "\"quoted\" 'x' 10' a-b"


def test_whitespace_and_line_structure():
    assert normalise("a\u00a0b\u2009c\u3000d\te\x0bf\x0cg") == "a b c d e f g"
    assert normalise("one\r\ntwo\rthree\u2028four\x85five") == "one\ntwo\nthree\nfour\nfive"
    assert normalise("  x  \n\n\n  y \n") == "x\ny"
    assert normalise("zero\u200bwidth\ufeff \x00\x07bell\x7f\x9b") == "zerowidth bell"
    assert normalise("") == ""


def test_the_loader_delegates_to_the_one_normaliser():
    for raw in REAL:
        assert normalise_text(raw) == normalise(raw)
    known = known_words(ASY_P90)
    assert normalise_text(ASY_P90, known=known) == normalise(ASY_P90, known=known)


# --- dropped ligatures --------------------------------------------------------------------------------------

# Constructed: no text layer of the Debian PDFs lost its ligatures. This is what such a layer reads like, the
# glyph turned into a gap (pdfium's spacing heuristic) or gone.
GAPPED = ("The function is de ned in the con guration le. Each eld is speci ed below; the e ect is di erent "
          "for o cial\nuses. The rst step de nes the work ow.")
VANISHED = "The function is dened in the conguration le. Each eld is specied below; the eect is dierent."


def test_dropped_ligatures_are_restored_with_a_dictionary():
    out = normalise(GAPPED, known=known_words(GAPPED))
    for word in ("defined", "configuration", "field", "specified", "effect", "different", "official", "first",
                 "defines"):
        assert word in out.replace(".", " ").replace(";", " ").split(), word
    # What stays: "le" (file) and "ow" (workflow) are words of the dictionary or miss from it.
    assert "le." in out.split() and "ow." in out.split()
    out = normalise(VANISHED, known=known_words(VANISHED))
    assert "defined" in out and "configuration" in out and "specified" in out and "different" in out
    assert normalise(GAPPED) == GAPPED  # without a dictionary, never


def test_a_repair_keeps_capitals_and_punctuation():
    text = "Speci ed: (de ned) Eld eld. Dened, dened"
    assert normalise(text, known=is_english_word) == "Specified: (defined) Field field. Defined, defined"


@pytest.mark.parametrize("raw", INTACT)
def test_intact_real_text_is_not_repaired(raw):
    known = known_words(raw)
    assert normalise(raw, known=known) == normalise(raw)


# --- idempotence and speed ----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [*REAL, GAPPED, VANISHED])
def test_normalise_is_idempotent_on_real_text(raw):
    once = normalise(raw)
    assert normalise(once) == once
    known = known_words(raw)
    fixed = normalise(raw, known=known)
    assert normalise(fixed, known=known) == fixed
    assert normalise(fixed) == fixed  # what the lexical encoder does to stored page text


def test_normalise_is_idempotent_on_random_text():
    pieces = ["a", "Z", "fi", " ", "  ", "\n", "\r\n", "\r", "-", "-\n", "\ufffe", "\x02", "\u00ad", "\ufb01",
              "\u00a0", "\t", "\x0c", "\u2019", "\u2212", "\u2011", "e\u0301", "\u0301", "\x00", "\x88", "\u2028",
              "\u200b", "word", "Word", "WORD", "x", "1", "(", ")", ".", "de", "ned", "eld", "ﬀ", "\uff21", "\u00b2",
              "\u00b4", "\u02c6", "\u0131", " \u0301"]
    rng = random.Random(1234)
    for _ in range(3000):
        raw = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        once = normalise(raw)
        assert normalise(once) == once, repr(raw)
        fixed = normalise(raw, known=is_english_word)
        assert normalise(fixed, known=is_english_word) == fixed, repr(raw)


def _best_of(fn, runs: int = 20) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def test_a_page_normalises_in_well_under_a_millisecond():
    page = ("\r\n".join(REAL) * 2)[:3000]
    assert len(page) == 3000
    known = known_words(page)
    normalise(page, known=known)  # warm the dictionary's caches
    assert _best_of(lambda: normalise(page)) < 0.001
    assert _best_of(lambda: normalise(page, known=known_words(page))) < 0.010


# --- captions -----------------------------------------------------------------------------------------------


def test_the_figure_caption_of_a_real_page():
    # CAD.pdf p.6, the only "Figure N:" caption in the Debian manuals; wrapped, its second line joins it.
    assert captions(normalise(CAD_P6)) == [
        Caption("figure", "1", "Figure 1: Example showing the measurement capabilities and a small freehand line.")
    ]


@pytest.mark.parametrize("raw", [CAD_P5, GNUPLOT_P165])
def test_references_in_running_text_are_not_captions(raw):
    # CAD.pdf p.5 "To produce figure 1, use this code:"; gnuplot.pdf p.165 "...\nFigure 7 caption" in a string.
    assert captions(normalise(raw)) == []


def test_caption_styles():
    page = "\n".join([
        "Figure 12: Throughput of the two engines.",
        "Figure 12. Again, with a full stop",
        "Fig. 3 Results of the fit",
        "FIGURE 4 ARCHITECTURE",
        "Table 2: Parameters used",
        "TABLE IV",
        "Listing 1",
        "Figure A.1 - appendix figure",
        "Figure 3.2\u2014Detail",
        "Fig. 5",
    ])
    assert [(c.kind, c.number) for c in captions(page)] == [
        ("figure", "12"), ("figure", "12"), ("figure", "3"), ("figure", "4"), ("table", "2"), ("table", "IV"),
        ("listing", "1"), ("figure", "A.1"), ("figure", "3.2"), ("figure", "5"),
    ]
    assert captions(page)[2].text == "Fig. 3 Results of the fit"


@pytest.mark.parametrize("page", [
    "As the results in Figure 12 show, it is fast.",  # not at a line start
    "Figure 3 shows the whole pipeline.",  # a sentence about the figure
    "The throughput is shown in\nFigure 3. It doubles.",  # a sentence carrying over a line end
    "figure 1, use this code:",  # lower case
    "Configure 5 things",
    "Figures of speech",
])
def test_mentions_are_not_captions(page):
    assert captions(page) == []


def test_a_slide_title_is_its_first_line_that_is_not_page_furniture():
    text = normalise("12\n- 4 -\nQuarterly results\nRevenue grew 12%\nFigure 2: Revenue by region")
    assert captions(text, slide=True) == [
        Caption("title", None, "Quarterly results"),
        Caption("figure", "2", "Figure 2: Revenue by region"),
    ]
    assert captions(text) == [Caption("figure", "2", "Figure 2: Revenue by region")]
    assert captions("Page 3 of 10\n\u00a9 2024 ACME\nAgenda", slide=True)[0].text == "Agenda"
    assert captions("", slide=True) == []


# --- figure references in questions ---------------------------------------------------------------------------


def test_figure_refs_in_questions():
    assert figure_refs("What does Figure 12 show, compared with fig. 3.2 and Table A.1?") == [
        ("figure", "12"), ("figure", "3.2"), ("table", "A.1")]
    assert figure_refs("FIGURE 7 vs figure 7") == [("figure", "7")]
    assert figure_refs("figures 3 and 4") == [("figure", "3"), ("figure", "4")]
    assert figure_refs("Figs. 2\u20134") == [("figure", "2"), ("figure", "3"), ("figure", "4")]
    assert figure_refs("figure 2-1") == [("figure", "2-1")]  # singular: a number, not a range
    assert figure_refs("Table IV and table iv and Table 1 and Ivan") == [("table", "IV"), ("table", "1")]
    assert figure_refs("listing 3, tab. 5") == [("listing", "3"), ("table", "5")]
    assert figure_refs("how do I configure 5 plots? the figure shows") == []
