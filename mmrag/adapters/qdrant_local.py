"""Sparse scoring and multi-vector re-ranking for Qdrant's local mode at the speed retrieval needs.

qdrant-client's local mode (``QdrantClient(path=...)``, ``":memory:"``) scores a sparse query by merging its
indices with every point's, one point at a time in pure Python (``local/sparse_distances.py``): about 230 ms per
query at 2,000 pages of ~200 terms on 2 cores, seconds at 10k. A Qdrant server uses an inverted index instead.
:func:`install` replaces that one function, as local mode's collection module calls it, with the same scores
from a compressed sparse matrix of the collection's vectors: built once per change of the collection (an upsert
or delete replaces the point's vector object, which the cache notices), then one sparse matrix product a query.

Same contract as the function it replaces: a float32 score per point, the dot product with the query, and
``-inf`` for a point that shares no index with it (0.0 with ``empty_is_zero``).

The late-interaction channel's two-stage query (a pooled vector prefetches, MaxSim over the multi-vectors
re-ranks) has the same problem: local mode re-scores a prefetch by searching the whole collection with an
"id in the prefetched set" filter, so it computes MaxSim for every page (0.9 ms a page: 9 s at 10k) and then
drops all but the prefetched ones. :func:`install` also makes that re-score compute MaxSim for the prefetched
pages only, with local mode's own scoring function, as a Qdrant server does.

A payload filter is the third: local mode evaluates it point by point in Python on every query (the encoder
scope every served search carries, and the figure points' exclusion: ~100 ms a request at 10k pages, where
the unfiltered dense search takes 10). :func:`install` keeps each filter's mask per collection until the
collection changes (every method that writes a point, a payload or a vector bumps a version), as a Qdrant
server keeps payload indexes.

``tests/test_qdrant_local.py`` checks all three against qdrant-client's own results. Everything else in local mode
is qdrant-client's own. :data:`FENCE` (mmrag/adapters/fences.py) names the releases this was tested with and the
functions it replaces: on a release where they changed shape, :func:`install` leaves local mode as it is (correct,
at local mode's own speed) and logs why.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from mmrag.adapters.fences import Fence, PatchFenceError, Target

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
# id(the first vector object of a collection's sparse vector list) -> (a snapshot of that list, its matrix). Local
# mode passes a fresh slice of its list on every query, so the list's own id cannot key it. The snapshot holds the
# vector objects, so their ids cannot be reused while the entry lives: "every object is the same" means
# "unchanged" (an upsert or delete puts a new object in the point's place). At most _ENTRIES (least recently
# used dropped): one per sparse vector of each collection in use.
_CACHE: OrderedDict[int, tuple[list[Any], _Matrix]] = OrderedDict()
_ENTRIES = 16
_ORIGINAL: dict[str, Any] = {}


class _Matrix:
    """A collection's sparse vectors as CSC over its distinct indices (columns), for column-sliced products."""

    def __init__(self, vectors: list[Any]) -> None:
        from scipy.sparse import csc_matrix

        lengths = np.fromiter((len(v.indices) for v in vectors), dtype=np.int64, count=len(vectors))
        total = int(lengths.sum())
        cols = np.fromiter(itertools.chain.from_iterable(v.indices for v in vectors), dtype=np.int64, count=total)
        vals = np.fromiter(itertools.chain.from_iterable(v.values for v in vectors), dtype=np.float64, count=total)
        rows = np.repeat(np.arange(len(vectors), dtype=np.int64), lengths)
        self.vocab, compact = np.unique(cols, return_inverse=True)
        shape = (len(vectors), len(self.vocab))
        self.values = csc_matrix((vals, (rows, compact)), shape=shape)
        self.present = csc_matrix((np.ones(total), (rows, compact)), shape=shape)

    def scores(self, indices: list[int], values: list[float], empty_is_zero: bool) -> np.ndarray:
        n = self.values.shape[0]
        q = np.asarray(indices, dtype=np.int64)
        at = np.searchsorted(self.vocab, q)
        hit = at < len(self.vocab)
        hit[hit] = self.vocab[at[hit]] == q[hit]
        if not hit.any():
            return np.full(n, 0.0 if empty_is_zero else -np.inf, dtype=np.float32)
        cols = at[hit]
        weights = np.asarray(values, dtype=np.float64)[hit]
        scores = self.values[:, cols] @ weights
        if not empty_is_zero:
            overlap = (self.present[:, cols] @ np.ones(len(cols))) > 0
            scores = np.where(overlap, scores, -np.inf)
        return scores.astype(np.float32)


def _matrix(vectors: list[Any]) -> _Matrix:
    key = id(vectors[0])
    with _LOCK:
        entry = _CACHE.get(key)
        if entry is not None and len(entry[0]) == len(vectors) and all(a is b for a, b in zip(entry[0], vectors)):
            _CACHE.move_to_end(key)
            return entry[1]
        matrix = _Matrix(vectors)
        _CACHE[key] = (list(vectors), matrix)
        _CACHE.move_to_end(key)
        while len(_CACHE) > _ENTRIES:
            _CACHE.popitem(last=False)
        return matrix


def calculate_distance_sparse(query: Any, vectors: list[Any], empty_is_zero: bool = False) -> np.ndarray:
    """Drop-in for ``qdrant_client.local.sparse_distances.calculate_distance_sparse`` (see the module docstring)."""
    if not vectors:
        return np.array([], dtype=np.float32)
    return _matrix(vectors).scores(list(query.indices), list(query.values), empty_is_zero)


def _multi_query(query: Any) -> np.ndarray | None:
    """The query matrix of a plain nearest multi-vector query (what a MaxSim re-rank asks), else None."""
    from qdrant_client.http import models

    nearest = query.nearest if isinstance(query, models.NearestQuery) and query.mmr is None else query
    if isinstance(nearest, list) and nearest and isinstance(nearest[0], list):
        return np.array(nearest)
    return None


def _merge_sources(self: Any, sources: list[list[Any]], query: Any, limit: int, offset: int, using: str | None = None,
                   query_filter: Any = None, score_threshold: float | None = None, with_payload: Any = True,
                   with_vectors: Any = False, idf_corpus: Any = None) -> list[Any]:
    """LocalCollection._merge_sources, with a multi-vector re-score computed over the prefetched points only."""
    matrix = _multi_query(query)
    original = _ORIGINAL["_merge_sources"]
    if matrix is None or using not in getattr(self, "multivectors", {}):
        return original(self, sources, query, limit, offset, using=using, query_filter=query_filter,
                        score_threshold=score_threshold, with_payload=with_payload, with_vectors=with_vectors,
                        idf_corpus=idf_corpus)
    from qdrant_client.http import models
    from qdrant_client.local import local_collection as lc

    # The prefetches ran under the query's filter (propagated down, as on a server): every candidate passes it.
    candidates = [self.ids[i] for i in dict.fromkeys(p.id for source in sources for p in source)]
    if not candidates:
        return []
    distance = self.get_vector_params(using).distance
    scores = lc.calculate_multi_distance(matrix, [self.multivectors[using][i] for i in candidates], distance)
    bigger = lc.distance_to_order(distance) == lc.DistanceOrder.BIGGER_IS_BETTER
    order = np.argsort(-scores if bigger else scores, kind="stable")
    out = []
    for k in order:
        score = float(scores[k])
        if score_threshold is not None and (score < score_threshold if bigger else score > score_threshold):
            continue
        idx = candidates[k]
        out.append(models.ScoredPoint(id=self.ids_inv[idx], score=score, version=0,
                                      payload=self._get_payload(idx, with_payload),
                                      vector=self._get_vectors(idx, with_vectors)))
        if len(out) >= limit + offset:
            break
    return out[offset:]


def install() -> None:
    """Make local mode's collections score sparse queries with :func:`calculate_distance_sparse`, and re-rank a
    multi-vector prefetch over the prefetched points only. Idempotent. On a qdrant-client whose patched functions
    changed shape (:data:`FENCE`), nothing is patched and a warning says why."""
    from qdrant_client.local import local_collection

    with _LOCK:
        if "fence" not in _ORIGINAL:
            _ORIGINAL["fence"] = None
            try:
                untested = FENCE.check()
            except PatchFenceError as exc:
                _ORIGINAL["fence"] = exc
                log.warning("%s Qdrant's local mode runs unpatched: correct, at its own speed.", exc)
            else:
                if untested is not None:
                    log.warning("%s; the functions it replaces keep their shape, so it applies.", untested)
        if _ORIGINAL["fence"] is not None:
            return
        if "calculate_distance_sparse" not in _ORIGINAL:
            _ORIGINAL["calculate_distance_sparse"] = local_collection.calculate_distance_sparse
            local_collection.calculate_distance_sparse = calculate_distance_sparse
        if "_merge_sources" not in _ORIGINAL:
            _ORIGINAL["_merge_sources"] = local_collection.LocalCollection._merge_sources
            local_collection.LocalCollection._merge_sources = _merge_sources
        if "_payload_and_non_deleted_mask" not in _ORIGINAL:
            cls = local_collection.LocalCollection
            _ORIGINAL["_payload_and_non_deleted_mask"] = cls._payload_and_non_deleted_mask
            for name in _WRITES:
                setattr(cls, name, _bumping(getattr(cls, name)))
            cls._payload_and_non_deleted_mask = _payload_and_non_deleted_mask


# Every LocalCollection method that changes a point's payload, vectors or presence: each bumps the collection's
# version before and after it runs, so a mask computed while it ran is never kept as current.
_WRITES = ("upsert", "update_vectors", "delete_vectors", "delete", "set_payload", "overwrite_payload",
           "delete_payload", "clear_payload", "batch_update_points", "_update_point", "_upsert_point", "_add_point",
           "_delete_ids", "delete_vector_name")

_LOCAL = "qdrant_client.local.local_collection"
# What install() replaces or calls in local mode, as tested (pyproject.toml pins the same range).
FENCE = Fence(("qdrant-client",), ">=1.19,<1.21", "mmrag/adapters/qdrant_local.py", (
    Target(_LOCAL, "calculate_distance_sparse", ("query", "vectors", "empty_is_zero")),
    Target("qdrant_client.local.sparse_distances", "calculate_distance_sparse", ("query", "vectors", "empty_is_zero")),
    Target(_LOCAL, "LocalCollection._merge_sources", ("self", "sources", "query", "limit", "offset", "using")),
    Target(_LOCAL, "LocalCollection._payload_and_non_deleted_mask", ("self", "payload_filter", "vector_name")),
    Target(_LOCAL, "calculate_payload_mask", ("payloads", "payload_filter", "ids_inv", "deleted_per_vector")),
    Target(_LOCAL, "validate_filter", ("payload_filter",)),
    *(Target(_LOCAL, f"LocalCollection.{name}") for name in _WRITES),
))
_MASKS_PER_COLLECTION = 64  # distinct filters kept (least recently used dropped): scopes, document filters


def _bumping(method: Any) -> Any:
    def write(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_mmrag_version"] = self.__dict__.get("_mmrag_version", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self.__dict__["_mmrag_version"] += 1

    write.__wrapped__ = method  # type: ignore[attr-defined]
    return write


def _payload_and_non_deleted_mask(self: Any, payload_filter: Any, vector_name: str | None = None) -> np.ndarray:
    """Local mode's own mask (qdrant_client/local/local_collection.py), its payload part kept per filter until
    the collection is written to."""
    from qdrant_client.local.local_collection import calculate_payload_mask, validate_filter

    if payload_filter is None:
        return _ORIGINAL["_payload_and_non_deleted_mask"](self, payload_filter, vector_name)
    validate_filter(payload_filter)
    version = self.__dict__.get("_mmrag_version", 0)
    masks: OrderedDict[str, tuple[int, np.ndarray]] = self.__dict__.setdefault("_mmrag_masks", OrderedDict())
    key = payload_filter.model_dump_json()
    with _LOCK:
        cached = masks.get(key)
        if cached is not None and cached[0] == version and len(cached[1]) == len(self.deleted):
            masks.move_to_end(key)
            payload_mask = cached[1]
        else:
            payload_mask = None
    if payload_mask is None:
        payload_mask = calculate_payload_mask(payloads=self.payload, payload_filter=payload_filter,
                                              ids_inv=self.ids_inv, deleted_per_vector=self.deleted_per_vector)
        payload_mask.setflags(write=False)
        with _LOCK:
            masks[key] = (version, payload_mask)  # the version read before: a write meanwhile makes it stale
            masks.move_to_end(key)
            while len(masks) > _MASKS_PER_COLLECTION:
                masks.popitem(last=False)
    mask = payload_mask & ~self.deleted
    if vector_name is not None:
        mask = mask & ~self.deleted_per_vector[vector_name]
    return mask


def original_merge_sources() -> Any:
    """LocalCollection's own _merge_sources (what :func:`install` wrapped), for comparison."""
    return _ORIGINAL.get("_merge_sources")


def original_calculate_distance_sparse() -> Any:
    """qdrant-client's own function (what :func:`install` replaced), for comparison."""
    from qdrant_client.local import sparse_distances

    return sparse_distances.calculate_distance_sparse
