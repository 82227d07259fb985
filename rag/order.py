"""Canonical image order: the one layout that lets plans of a batch share the longest image prefixes.

Every plan lists its pages in one global order: pages used by more plans of the batch first, ties broken by
the key. Plans {A,B}, {A,C}, {A,B,D} become [A,B], [A,C], [A,B,D]: all three share the prefix A, and two of
them share A,B. A pure function over plain lists, testable without an engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def canonical_order(plans: Sequence[Sequence[K]]) -> list[list[K]]:
    """Each plan's distinct pages, sorted by (-number of plans using the page, page key)."""
    uses = Counter(k for plan in plans for k in set(plan))
    return [sorted(set(plan), key=lambda k: (-uses[k], k)) for plan in plans]
