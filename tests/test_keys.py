"""The image-token key: one typed value with one string form, which vLLM will use verbatim as its cache key."""

import hashlib

import pytest

from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy, content_hash_of, page_point_id

H1 = ContentHash(hashlib.sha256(b"a").hexdigest())
H2 = ContentHash(hashlib.sha256(b"b").hexdigest())
V1 = EncoderVersion("0123456789abcdef")
P = ResolutionPolicy(3136, 200704)


def test_string_form_round_trips_and_carries_every_component():
    key = ImageKey(H1, V1, P)
    assert ImageKey.parse(str(key)) == key
    assert H1 in str(key) and V1 in str(key) and str(P) in str(key)


def test_keys_differ_when_any_component_differs():
    base = ImageKey(H1, V1, P)
    others = [
        ImageKey(H2, V1, P),
        ImageKey(H1, EncoderVersion("fedcba9876543210"), P),
        ImageKey(H1, V1, ResolutionPolicy(3136, 100352)),
    ]
    assert len({str(k) for k in [base, *others]}) == 4


@pytest.mark.parametrize("bad", ["", "img1-xyz", f"img1-{H1}-{V1}-px1", f"img1-{H1[:-1]}-{V1}-px1-2"])
def test_parse_rejects_malformed_keys(bad):
    with pytest.raises(ValueError):
        ImageKey.parse(bad)


def test_resolution_policy_rejects_inverted_bounds_with_the_fix():
    with pytest.raises(ValueError, match="MMRAG_MIN_PIXELS"):
        ResolutionPolicy(1000, 10)


def test_content_hash_covers_mode_size_and_pixels():
    px = bytes(12)
    assert content_hash_of("RGB", (2, 2), px) != content_hash_of("RGB", (4, 1), px)
    assert content_hash_of("RGB", (2, 2), px) != content_hash_of("RGB", (2, 2), b"\x01" + px[1:])
    assert content_hash_of("RGB", (2, 2), px) == content_hash_of("RGB", (2, 2), bytes(12))


def test_point_ids_are_stable_per_page_and_distinct_across_pages():
    assert page_point_id("d1", 1) == page_point_id("d1", 1)
    assert len({page_point_id("d1", 1), page_point_id("d1", 2), page_point_id("d2", 1)}) == 3
