"""Image orders on plain lists. Canonical: pages shared by more plans of the batch come first, ties broken by
key. Global (PagePopularity): pages asked more often so far come first, in bounded memory, stably."""

import random
from collections.abc import Sequence

import pytest

from rag.order import PagePopularity, canonical_order


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


def observed(*uses: tuple[str, int]) -> PagePopularity:
    """A popularity table that has seen each page the given number of times, one sub-question per use."""
    pop = PagePopularity()
    for key, n in uses:
        for _ in range(n):
            pop.observe([key])
    return pop


def test_popularity_ranks_known_pages_by_count_then_unknown_pages_by_key():
    pop = observed(("c", 9), ("a", 3), ("b", 1))
    assert [pop.count(k) for k in "abcz"] == [3, 1, 9, 0]
    assert pop.order(["z", "b", "a", "y", "c", "c"]) == ["c", "a", "b", "y", "z"]


def test_one_observation_counts_each_distinct_page_once():
    pop = PagePopularity()
    pop.observe(["a", "a", "b"])
    pop.observe(iter(["a"]))
    assert (pop.count("a"), pop.count("b"), len(pop)) == (2, 1, 2)


def test_close_counts_do_not_swap_pages_only_a_power_of_two_does():
    # b passes a (6 > 5, then 7) without moving ahead of it: both are in the 4-7 level, ties by key. An order
    # by exact count would have swapped them, changing every prompt holding both and losing its cache hits.
    pop = observed(("a", 5), ("b", 6))
    assert pop.order(["b", "a"]) == ["a", "b"]
    pop.observe(["b"])
    assert pop.count("b") == 7 and pop.order(["b", "a"]) == ["a", "b"]
    pop.observe(["b"])  # 8: a level up
    assert pop.order(["a", "b"]) == ["b", "a"]


def test_memory_stays_bounded_and_frequent_pages_stay_tracked_under_many_distinct_pages():
    pop = PagePopularity(capacity=64)
    for i in range(20_000):
        pop.observe([f"rare-{i}"])
        if i % 10 == 0:
            pop.observe(["hot"])
    assert len(pop) == 64
    # Space-Saving keeps every page asked more than observations / capacity times, counted at least that often.
    assert pop.count("hot") >= 2_000
    assert pop.order(["rare-5", "hot", "rare-19999"])[0] == "hot"


def test_the_order_is_the_same_for_the_same_observations():
    rng = random.Random(7)
    # 300 pages, skewed (the lower of two uniform draws), through a 50-page table: evictions all the time.
    page = lambda: f"p{min(rng.randrange(300), rng.randrange(300))}"  # noqa: E731
    stream = [{page() for _ in range(rng.randint(1, 3))} for _ in range(5_000)]
    first, second = PagePopularity(capacity=50), PagePopularity(capacity=50)
    for keys in stream:
        first.observe(keys)
        second.observe(sorted(keys, reverse=True))  # the order of a call's keys does not matter
    pages = sorted({k for keys in stream for k in keys})
    assert first.order(pages) == second.order(pages)
    assert [first.count(k) for k in pages] == [second.count(k) for k in pages]


def test_capacity_must_hold_a_page():
    with pytest.raises(ValueError, match="at least 1"):
        PagePopularity(capacity=0)


def test_a_second_page_recurs_behind_the_same_first_page_across_requests():
    # Page B is asked with P in two requests, co-retrieved with different pages. The canonical order ranks by
    # the batch, so B leads in the first request ([B, P]) and follows in the second ([P, B]): the second
    # request's B cannot reuse the first one's KV. The global order renders {P, B} as [P, B] both times.
    requests = [[["P", "B"], ["B", "C"]], [["P", "B"], ["P", "D"]]]
    assert [canonical_order(r)[0] for r in requests] == [["B", "P"], ["P", "B"]]
    pop = observed(("P", 8), ("B", 4), ("C", 1), ("D", 1))  # the traffic so far
    pairs = []
    for plans in requests:
        for plan in plans:
            pop.observe(plan)
        pairs.append(pop.order(plans[0]))
    assert pairs == [["P", "B"], ["P", "B"]]
