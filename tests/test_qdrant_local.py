"""mmrag/adapters/qdrant_local.py: local mode's sparse scoring as a cached matrix product gives qdrant-client's own
scores, follows upserts and deletes, and keeps the -inf of a point that shares no index with the query."""

from __future__ import annotations

import numpy as np
import pytest
from qdrant_client import QdrantClient, models

from mmrag.adapters import qdrant_local

qdrant_local.install()  # what importing mmrag.adapters.qdrant does


def random_vectors(rng, n, vocab=500, terms=30):
    out = []
    for _ in range(n):
        idx = sorted(set(rng.integers(0, vocab, size=rng.integers(0, terms)).tolist()))
        out.append(models.SparseVector(indices=idx, values=rng.random(len(idx)).tolist()))
    return out


@pytest.mark.parametrize("empty_is_zero", [False, True])
def test_scores_equal_qdrant_clients_own(empty_is_zero):
    rng = np.random.default_rng(0)
    vectors = random_vectors(rng, 300)
    original = qdrant_local.original_calculate_distance_sparse()
    for query in random_vectors(rng, 20, terms=6) + [models.SparseVector(indices=[10_000], values=[1.0])]:
        want = original(query, vectors, empty_is_zero=empty_is_zero)
        got = qdrant_local.calculate_distance_sparse(query, vectors, empty_is_zero=empty_is_zero)
        assert got.dtype == np.float32 and np.array_equal(np.isinf(want), np.isinf(got))
        assert np.allclose(want[~np.isinf(want)], got[~np.isinf(got)], rtol=1e-6)


def test_a_local_collection_searched_after_upserts_and_deletes_matches_a_brute_force_ranking():
    rng = np.random.default_rng(1)
    client = QdrantClient(":memory:")
    client.create_collection("c", vectors_config={},
                             sparse_vectors_config={"s": models.SparseVectorParams(modifier=models.Modifier.IDF)})
    vectors = dict(enumerate(random_vectors(rng, 200)))
    client.upsert("c", [models.PointStruct(id=i, vector={"s": v}) for i, v in vectors.items()])
    query = models.SparseVector(indices=[1, 2, 3, 50, 99], values=[1.0] * 5)

    def expected():
        n = len(vectors)
        df = {t: sum(t in v.indices for v in vectors.values()) for t in query.indices}
        idf = {t: np.log((n - df[t] + 0.5) / (df[t] + 0.5) + 1) for t in query.indices}
        scores = {i: sum(val * idf[t] for t, val in zip(v.indices, v.values) if t in idf) for i, v in vectors.items()
                  if set(v.indices) & set(query.indices)}
        return sorted(scores, key=lambda i: -scores[i])[:10]

    def found():
        return [p.id for p in client.query_points("c", query=query, using="s", limit=10).points]

    assert found() == expected()
    vectors[5] = models.SparseVector(indices=[1, 2, 3, 50, 99], values=[9.0] * 5)  # now the best match
    client.upsert("c", [models.PointStruct(id=5, vector={"s": vectors[5]})])
    assert found()[0] == 5 and found() == expected()
    client.delete("c", points_selector=models.PointIdsList(points=[5]))
    del vectors[5]
    assert found() == expected()


def test_a_multi_vector_re_rank_scores_only_the_prefetch_and_equals_qdrant_clients_own_result():
    from qdrant_client.local import local_collection

    rng = np.random.default_rng(2)
    client = QdrantClient(":memory:")
    client.create_collection("m", vectors_config={
        "mean": models.VectorParams(size=8, distance=models.Distance.COSINE),
        "page": models.VectorParams(size=8, distance=models.Distance.COSINE, hnsw_config=models.HnswConfigDiff(m=0),
                                    multivector_config=models.MultiVectorConfig(
                                        comparator=models.MultiVectorComparator.MAX_SIM))})
    points = []
    for i in range(120):
        multi = rng.standard_normal((int(rng.integers(3, 9)), 8))
        points.append(models.PointStruct(id=i, vector={"mean": multi.mean(0).tolist(), "page": multi.tolist()},
                                         payload={"group": i % 3}))
    client.upsert("m", points)
    query = rng.standard_normal((4, 8))
    flt = models.Filter(must=[models.FieldCondition(key="group", match=models.MatchValue(value=1))])

    def ask():
        return client.query_points("m", prefetch=[models.Prefetch(query=query.mean(0).tolist(), using="mean", limit=15)],
                                   query=query.tolist(), using="page", limit=6, query_filter=flt).points

    scored = []
    real = local_collection.calculate_multi_distance
    local_collection.calculate_multi_distance = lambda q, ms, d: scored.append(len(ms)) or real(q, ms, d)
    try:
        fast = ask()
        assert scored == [15]  # the prefetched pages, not all 120
        local_collection.LocalCollection._merge_sources = qdrant_local.original_merge_sources()
        slow = ask()
    finally:
        local_collection.calculate_multi_distance = real
        local_collection.LocalCollection._merge_sources = qdrant_local._merge_sources
    assert [p.id for p in fast] == [p.id for p in slow] and all(p.payload["group"] == 1 for p in fast)
    assert [p.score for p in fast] == pytest.approx([p.score for p in slow], rel=1e-6)


def test_a_filtered_search_keeps_its_mask_until_the_collection_is_written_to():
    """The payload mask is kept per filter (one evaluation, not one per query) and follows every kind of write:
    an upsert, a payload change, a delete; filtered results equal a brute-force ranking of the matching points."""
    rng = np.random.default_rng(3)
    client = QdrantClient(":memory:")
    client.create_collection("c", vectors_config={"d": models.VectorParams(size=8, distance=models.Distance.DOT)})
    rows = {i: rng.standard_normal(8) for i in range(300)}
    kinds = {i: "figure" if i % 7 == 0 else "page" for i in rows}
    client.upsert("c", [models.PointStruct(id=i, vector={"d": v.tolist()}, payload={"kind": kinds[i]})
                        for i, v in rows.items()])
    query = rng.standard_normal(8)
    pages = models.Filter(must_not=[models.FieldCondition(key="kind", match=models.MatchValue(value="figure"))])
    evaluated = []
    from qdrant_client.local import local_collection

    real = local_collection.calculate_payload_mask

    def counting(**kwargs):
        evaluated.append(1)
        return real(**kwargs)

    local_collection.calculate_payload_mask = counting
    try:
        def found():
            return [p.id for p in client.query_points("c", query=query.tolist(), using="d", query_filter=pages,
                                                      limit=10).points]

        def expected():
            scores = {i: float(v @ query) for i, v in rows.items() if kinds[i] == "page"}
            return sorted(scores, key=lambda i: -scores[i])[:10]

        assert found() == expected() and found() == expected()
        assert len(evaluated) == 1  # the second query reused the mask
        best = expected()[0]
        client.set_payload("c", payload={"kind": "figure"}, points=[best])  # now excluded
        kinds[best] = "figure"
        assert found() == expected() and best not in found()
        rows[999] = query * 10  # a new page, the best match
        kinds[999] = "page"
        client.upsert("c", [models.PointStruct(id=999, vector={"d": rows[999].tolist()}, payload={"kind": "page"})])
        assert found()[0] == 999 and found() == expected()
        client.delete("c", points_selector=models.PointIdsList(points=[999]))
        del rows[999], kinds[999]
        assert found() == expected()
        assert len(evaluated) == 4  # once per state of the collection
    finally:
        local_collection.calculate_payload_mask = real
