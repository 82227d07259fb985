"""Channel fusion (retrieval/search.py Fusion) on hand-made rankings: weighted RRF and scaled-score sums."""

from types import SimpleNamespace

import pytest

from retrieval.search import RRF_K, Channel, Fusion


def ranked(*pairs):
    return [SimpleNamespace(id=i, score=s) for i, s in pairs]


RANKS = {Channel.TEXT: ranked(("a", 0.9), ("b", 0.8), ("c", 0.1)),
         Channel.LEXICAL: ranked(("c", 12.0), ("a", 3.0)),
         Channel.IMAGE: ranked(("d", 0.3))}


def test_rrf_sums_each_channels_weight_over_k_plus_rank():
    fused = dict((p.id, s) for s, p in Fusion("rrf", {"text": 1, "lexical": 2, "image": 0.5}).fuse(RANKS))
    assert fused == pytest.approx({"a": 1 / (RRF_K + 1) + 2 / (RRF_K + 2), "b": 1 / (RRF_K + 2),
                                   "c": 1 / (RRF_K + 3) + 2 / (RRF_K + 1), "d": 0.5 / (RRF_K + 1)})


def test_score_fusion_scales_each_channel_to_0_1_then_weighs():
    fused = Fusion("score", {"text": 1, "lexical": 1, "image": 1}).fuse(RANKS)
    by_id = {p.id: s for s, p in fused}
    assert by_id == pytest.approx({"a": 1 + 0, "b": (0.8 - 0.1) / 0.8, "c": 0 + 1, "d": 1})
    assert [p.id for _, p in fused] == ["a", "c", "d", "b"]  # ties broken by id: a stable order


def test_a_channel_weighted_zero_adds_nothing_and_order_follows_the_rest():
    fused = Fusion("rrf", {"text": 0, "lexical": 1, "image": 0}).fuse(RANKS)
    assert [p.id for _, p in fused] == ["c", "a"]


def test_an_unknown_method_names_the_choices():
    with pytest.raises(ValueError, match="rrf or score"):
        Fusion("max")


def test_settings_read_fusion_weights_and_name_the_fix_for_a_bad_one(tmp_path):
    from pydantic import ValidationError

    from mmrag.core.settings import Settings

    assert Settings(fusion_weights="lexical=3, image=0.5").retrieval.fusion_weight_table == {
        "text": 1.0, "lexical": 3.0, "image": 0.5, "caption": 1.0, "figure": 0.125}
    assert Settings().retrieval.fusion_weight_table["lexical"] == 2.0  # the measured default (mmrag/core/settings.py)
    for bad in ("lexical", "sparse=1", "text=-1", "text=heavy"):
        with pytest.raises(ValidationError, match="MMRAG_FUSION_WEIGHTS .*channel=weight"):
            Settings(fusion_weights=bad)
    with pytest.raises(ValidationError, match="MMRAG_PAGE_RETRIEVER=.* is not a folder"):
        Settings(page_retriever=str(tmp_path / "absent"))
    with pytest.raises(ValidationError, match="MMRAG_PAGE_RETRIEVER=clip needs CLIP weights"):
        Settings(page_retriever="clip", profile="production")  # random weights: the development profile's only
    with pytest.raises(ValidationError, match="raise MMRAG_CANDIDATE_K"):
        Settings(top_k=30, candidate_k=20)
