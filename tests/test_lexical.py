"""mmrag.adapters.lexical: BM25 sparse vectors for Qdrant (Modifier.IDF) and the offline word list."""

from __future__ import annotations

import pytest

from mmrag.adapters.lexical import (
    AVG_LEN,
    K1,
    LexicalEncoder,
    english_words,
    is_english_word,
    known_words,
    special_token,
    stem,
    token_index,
)
from mmrag.core.figures import Caption, captions, figure_refs
from mmrag.core.text import normalise
from tests.test_text_normalise import CAD_P5, CAD_P6, GNUPLOT_P22, GNUPLOT_P36, REAL


@pytest.fixture(scope="module")
def enc() -> LexicalEncoder:
    return LexicalEncoder()


def weights(vector: tuple[list[int], list[float]]) -> dict[int, float]:
    indices, values = vector
    assert indices == sorted(set(indices)), "Qdrant wants each index once"
    assert len(indices) == len(values)
    return dict(zip(indices, values, strict=True))


def weight_of(vector: tuple[list[int], list[float]], token: str) -> float:
    return weights(vector).get(token_index(token), 0.0)


# --- the word list ----------------------------------------------------------------------------------------------


def test_the_offline_word_list_is_the_minilm_vocabulary():
    words = english_words()
    assert 21000 < len(words) < 23000  # 21,745 whole-word entries of 30,522
    assert {"defined", "field", "configuration", "plot"} <= words
    assert not any(w.startswith("##") or not w.isalpha() for w in words)
    assert is_english_word("directories") and is_english_word("plotting") and is_english_word("defaults")
    assert not is_english_word("dened")  # not den+ed, which would be "denned": left to the ligature repair
    assert not is_english_word("xtics")


def test_known_words_adds_the_pages_words_but_not_the_halves_being_decided():
    known = known_words(CAD_P5)
    assert known("freehand") and known("defined")
    text = "lost ligatures: the eld is de ned here, and the eld again; see portabil\ufffeity"
    known = known_words(text)
    assert not known("eld")  # a page word that a ligature would make a word of
    assert not known("portabil") and not known("ity")


# --- tokens -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("set_xtics", ["set_xtics", "set", "xtic"]),
    ("--enable-foo", ["enable-foo", "enabl", "foo", "enablefoo"]),
    ("gp.plot()", ["gp.plot", "gp", "plot"]),
    ("\\draw", ["draw"]),
    ("x11", ["x11"]),
    ("2.5 and 5.4.1", ["2.5", "5.4.1"]),
    ("set logscale", ["set", "logscal"]),
    ("cad.MeasureParallel(", ["cad.measureparallel", "cad", "measureparallel", "measur", "parallel"]),
    ("command-line", ["command-line", "command", "line", "commandlin"]),
    ("The user's plots", ["user", "plot"]),
    ("set key off; not all", ["set", "key", "off", "not", "all"]),
])
def test_tokens(enc, text, expected):
    assert enc.tokens(text) == expected


def test_stemming_puts_inflections_together(enc):
    assert enc.tokens("plotting plots plotted") == ["plot"] * 3
    assert stem("plotting") == stem("plots") == "plot"


def test_a_tex_en_dash_option_matches_the_typed_one(enc):
    # gnuplot.pdf p.54 prints "--enable-raise-console" as "–enable-raise-console" (TeX's -- ligature).
    page = "If gnuplot was built with configuration option \u2013enable-raise-console, then typing <space>"
    assert set(enc.tokens("--enable-raise-console")) <= set(enc.tokens(page))


def test_queries_and_documents_are_tokenised_the_same(enc):
    for raw in REAL:
        words = {token_index(t) for t in enc.tokens(raw)}
        assert set(weights(enc.document(raw, []))) == words
        mentions = {token_index(special_token(kind, number)) for kind, number in figure_refs(raw)}
        assert set(weights(enc.query(raw))) == words | mentions
    # The page is stored normalised; the question is typed with ASCII quotes and a plain "fi".
    page = normalise(GNUPLOT_P22 + " the \ufb01le")
    assert set(weights(enc.query("plot 'data' file"))) <= set(weights(enc.document(page, [])))
    # A hyphenation mark joined at ingest finds the whole word, and the normaliser is applied again harmlessly.
    assert weight_of(enc.document(GNUPLOT_P36, []), "gnuplot") > 0
    assert enc.document(normalise(GNUPLOT_P36), []) == enc.document(GNUPLOT_P36, [])


# --- figure tokens ------------------------------------------------------------------------------------------------


def test_figure_tokens_come_from_captions_in_pages_and_from_mentions_in_questions(enc):
    caption_page, mention_page = normalise(CAD_P6), normalise(CAD_P5)  # CAD.pdf pp. 6 and 5
    assert weight_of(enc.document(caption_page, captions(caption_page)), "figure#1") > 0
    assert captions(mention_page) == []
    assert weight_of(enc.document(mention_page, captions(mention_page)), "figure#1") == 0  # "figure 1" in prose
    assert weight_of(enc.query("What does Figure 1 show?"), "figure#1") == 1.0
    assert weight_of(enc.query("what does fig. 1 show"), "figure#1") == 1.0
    assert weight_of(enc.query("figure#1"), "figure#1") == 0  # text never makes one
    assert special_token("table", "A.1") == "table#a.1"
    table = enc.document("Table A.1: Sizes", [Caption("table", "A.1", "Table A.1: Sizes")])
    assert weight_of(table, "table#a.1") > 0 and weight_of(enc.query("see table a.1"), "table#a.1") == 1.0


def test_caption_tokens_count_extra(enc):
    body = "Results\nThroughput of the engines per second"
    plain = enc.document(body, [])
    boosted = enc.document(body, [Caption("title", None, "Results")])
    assert weight_of(boosted, "result") > weight_of(plain, "result")
    assert weight_of(boosted, "throughput") == weight_of(plain, "throughput")
    assert weight_of(enc.document(body, [Caption("title", None, "Results")]), "title#none") == 0


# --- indices and BM25 -----------------------------------------------------------------------------------------------


def test_indices_are_a_stable_hash():
    # Literals: a change here changes every stored vector (bump LEXICAL_VERSION and re-index).
    assert token_index("plot") == 1213419949
    assert token_index("figure#12") == 2023260467
    assert token_index("set_xtics") == 196147554
    assert all(0 <= token_index(t) < 2**31 for t in ("", "a", "\u00e9t\u00e9", "x" * 64))


def test_bm25_saturates_with_term_frequency(enc):
    filler = " ".join(f"w{i}" for i in range(40))
    ones = weight_of(enc.document(f"plot {filler}", []), "plot")
    tens = weight_of(enc.document(" ".join(["plot"] * 10) + f" {filler}", []), "plot")
    assert ones < tens < 10 * ones
    assert tens < K1 + 1  # the ceiling of tf*(k1+1)/(tf+...)


def test_bm25_normalises_by_length(enc):
    short = weight_of(enc.document("plot " + " ".join(f"w{i}" for i in range(10)), []), "plot")
    long = weight_of(enc.document("plot " + " ".join(f"w{i}" for i in range(1000)), []), "plot")
    assert long < short
    average = " ".join(["plot"] + [f"w{i}" for i in range(int(AVG_LEN) - 1)])
    assert weight_of(enc.document(average, []), "plot") == pytest.approx(1.0)  # tf 1 at avg_len: 2.2/2.2


def test_queries_weigh_each_distinct_token_once(enc):
    vector = enc.query("plot plot plots Figure 12 figure 12")
    assert set(weights(vector).values()) == {1.0}
    assert set(weights(vector)) == {token_index(t) for t in ("plot", "figur", "12", "figure#12")}


def test_nothing_to_index(enc):
    assert enc.document("", []) == ([], [])
    assert enc.query("the of and") == ([], [])
