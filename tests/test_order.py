"""Canonical image order on plain lists: pages shared by more plans come first, ties broken by key."""

from collections.abc import Sequence

from rag.order import canonical_order


def shared_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the common leading run of two image lists (what the KV cache can share)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_plans_sharing_a_figure_start_with_it_then_the_next_most_shared():
    plans = [{"B", "A"}, {"C", "A"}, {"D", "B", "A"}]
    assert canonical_order(plans) == [["A", "B"], ["A", "C"], ["A", "B", "D"]]


def test_the_order_is_one_global_order_whatever_the_input_order():
    plans = [["D", "B", "A"], ["A", "C"], ["B", "A"]]
    ordered = canonical_order(plans)
    rank = {k: i for i, k in enumerate(["A", "B", "C", "D"])}
    assert all(p == sorted(p, key=rank.get) for p in ordered)
    assert canonical_order([list(reversed(p)) for p in plans]) == ordered


def test_ties_are_broken_by_key_and_duplicates_within_a_plan_collapse():
    assert canonical_order([["z", "y", "y"], ["x"]]) == [["y", "z"], ["x"]]


def test_canonical_order_shares_longer_prefixes_than_score_order():
    score_order = [["B", "A"], ["C", "A"], ["A", "B", "D"]]
    canon = canonical_order(score_order)
    pairs = [(i, j) for i in range(3) for j in range(i + 1, 3)]
    naive = sum(shared_prefix(score_order[i], score_order[j]) for i, j in pairs)
    ours = sum(shared_prefix(canon[i], canon[j]) for i, j in pairs)
    assert (naive, ours) == (0, 4)
