"""Image orders: the layouts that let plans share the longest image prefixes.

Canonical order (per batch): every plan of a batch lists its pages in one order, pages used by more plans
of the batch first, ties broken by the key. Plans {A,B}, {A,C}, {A,B,D} become [A,B], [A,C], [A,B,D]: all
three share the prefix A, and two of them share A,B. A pure function over plain lists, testable without an
engine.

Global order (per process, :class:`PagePopularity`): the same idea across requests, ranked by how often each
page has been asked so far, so a pair of pages renders the same way in every request that retrieves it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


def canonical_order(plans: Sequence[Sequence[K]]) -> list[list[K]]:
    """Each plan's distinct pages, sorted by (-number of plans using the page, page key)."""
    uses = Counter(k for plan in plans for k in set(plan))
    return [sorted(set(plan), key=lambda k: (-uses[k], k)) for plan in plans]


DEFAULT_CAPACITY = 4096  # pages tracked (~0.6 MiB, ~1.5 MiB with keys only it holds); past it, the rarest go


class PagePopularity(Generic[K]):
    """A global page order, stable across requests: pages ranked by how often they are asked, learned online.

    Why: the canonical order is per batch, so a pair of pages {A, B} renders as [A][B] in one request and
    [B][A] in another, and B's KV (which depends on every token before it) is reused only behind the same
    first page. One process-wide order renders every recurrence of {A, B} the same way, so B hits wherever
    the pair recurs. Popular pages go first so that prompts start with the pages whose prefixes recur most.

    Counting: Space-Saving (Metwally et al., 2005) over at most ``capacity`` pages. A page not tracked when the
    table is full replaces the least-counted one (among those, the one at that count longest) and inherits its
    count + 1, so every page asked more than (page uses so far) / capacity times is tracked. O(1) per page: pages
    sit in buckets of equal count (insertion-ordered dicts), so the least-counted one is found without a scan.

    Order: by descending count *level* (``count.bit_length()``: 1, 2-3, 4-7, 8-15, ...), ties and unknown
    pages by key. Stability over freshness: a rank change changes prefixes and costs cache hits, so two pages
    swap only when one crosses a power of two, not whenever their counts pass each other. A tracked page's
    count only grows, so it changes level at most log2(its count) + 1 times, and close counts never oscillate
    (only the least-counted pages are evicted, and they rank last anyway).

    Within a question it replaces the canonical order rather than breaking its ties: a rank by the batch
    would reorder a pair by what else the batch retrieved, the very flip it avoids. Pages the batch shares
    still lead where they are the more asked ones (the caller observes the question before ordering it).

    Deterministic for a given sequence of ``observe`` calls (the keys of one call are counted in key order,
    whatever their iteration order). Not thread-safe, and needs no lock: it lives in the process's one
    asyncio loop, and ``observe`` and ``order`` never await.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 page, got {capacity}")
        self.capacity = capacity
        self._counts: dict[K, int] = {}
        self._buckets: dict[int, dict[K, None]] = {}  # count -> its pages, in the order they reached it
        self._min = 0  # the smallest count in the table (0 when empty)

    def __len__(self) -> int:
        """Pages tracked: never more than ``capacity``."""
        return len(self._counts)

    def count(self, key: K) -> int:
        """Times ``key`` was observed (Space-Saving: an overestimate by at most the count it inherited); 0 if
        not tracked."""
        return self._counts.get(key, 0)

    def observe(self, keys: Iterable[K]) -> None:
        """One use of each distinct page in ``keys``: call it once per sub-question with its retrieved pages."""
        for key in sorted(set(keys)):
            self._bump(key)

    def order(self, keys: Iterable[K]) -> list[K]:
        """The distinct ``keys`` in the global order: known pages by descending count level, then by key."""
        return sorted(set(keys), key=lambda k: (-self.count(k).bit_length(), k))

    def _bump(self, key: K) -> None:
        count = self._counts.pop(key, 0)
        if count:
            self._leave(key, count)
        elif len(self._counts) >= self.capacity:
            count = self._min
            victim = next(iter(self._buckets[count]))
            self._leave(victim, count)
            del self._counts[victim]
        else:
            self._min = 1  # a new page: the smallest count there can be
        self._counts[key] = count + 1
        self._buckets.setdefault(count + 1, {})[key] = None

    def _leave(self, key: K, count: int) -> None:
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]
            if count == self._min:
                self._min = count + 1  # where the page leaving it (or the one replacing it) goes
