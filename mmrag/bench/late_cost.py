"""What late-interaction page retrieval costs in Qdrant: bytes per page, build time, query latency.

Pages are random unit multivectors shaped like ColQwen2 pages (``tokens_per_page`` rows of ``dim``; a real
ColQwen2 page at its default 768-visual-token cap is ~740-770 rows of 128, the tiny checkpoint's A4 page 753), a
query ``query_tokens`` rows (a ColQwen2 query: its tokens + 10 augmentation tokens, ~15-30). Costs depend on the
shapes only, not on what the vectors mean, so random data measures them; retrieval quality is not measured here.

Each page is one point with a multivector ``page`` (MAX_SIM, no HNSW graph: m=0) and a dense ``page_mean``
(``mmrag.adapters.late.mean_pool``). The two queries compared:

- two-stage: prefetch ``prefetch`` candidates by ``page_mean``, rerank them by MaxSim on ``page``, keep ``top_k``;
- single-stage: MaxSim over every page.

Variants: ``float32`` (full), ``pooledN`` (token pooling by N: ``tokens_per_page // N`` rows; random rows stand
in for pooled ones, as costs depend on the row count only), ``int8`` / ``binary`` (Qdrant scalar / binary
quantisation of ``page``).

Three kinds of figure, kept apart in the result:

- ``bytes``: the vector data per page on a Qdrant server, from its storage formats: float32 = 4 B per number;
  int8 scalar quantisation = dim rounded up to 16, + a 4-byte f32 correction, per vector (Qdrant's
  ``EncodedVectorsU8``); binary = 1 bit per number in 16-byte chunks; the 512-byte float32 ``page_mean`` on top.
  Quantised vectors sit in RAM beside the float32 originals (kept for rescoring, on disk with ``on_disk=True``),
  so ``ram`` and ``disk`` are given apart. Graph links of ``page_mean``'s HNSW (~2*m*4 = 128 B per point at
  m=16) are left out.
- ``local``: real Qdrant local mode (``QdrantClient(":memory:")``, the mode the tests use) at ``local_pages``
  pages: build time, its in-memory bytes, both queries' latency; extrapolated linearly to ``pages`` when
  ``local_pages`` is smaller (every point is validated and copied on upsert). Local mode as mmrag runs it:
  mmrag/adapters/qdrant_local.py makes its re-rank stage score the prefetched pages only (qdrant-client's own scores
  every stored multivector and then filters to the prefetched ids, so its two-stage query cost as much as a
  single-stage one: ~0.9 ms a page). Local mode ignores quantisation (it stores and scores
  float32 whatever ``quantization_config`` says: checked on a small collection each run), so quantised
  variants have no local latency.
- ``exact``: the arithmetic a server does per query, in numpy at the full ``pages`` scale (flat dot products
  for the prefetch, where a server walks an HNSW graph, so an upper bound there; float32 MaxSim of the
  candidates; single-stage MaxSim over every page). A compute floor for float32/pooled storage, not a Qdrant
  measurement; quantised kernels are Qdrant's own SIMD code and are not emulated.

BLAS runs ``blas_threads`` threads (1 by default: per-query latency on a serving host, and small matmuls with
2 OpenBLAS threads were ~100x slower on a busy 2-core machine).
"""

from __future__ import annotations

import os
import platform
import time
from contextlib import nullcontext
from typing import Any

import numpy as np

from mmrag.adapters.late import maxsim, mean_pool

FLOAT32 = "float32"
QUANTISED = ("int8", "binary")
DEFAULT_VARIANTS = ("float32", "pooled2", "pooled3", "pooled4", "int8", "binary")
# A real ColQwen2 page (A4 at the 768-visual-token cap) is ~740-770 rows; 760 is in that range.
COLQWEN2_PAGE_TOKENS = 760
_UPSERT_BATCH = 32


def _pool_factor(variant: str) -> int:
    if variant in (FLOAT32, *QUANTISED):
        return 1
    if variant.startswith("pooled") and variant[6:].isdigit() and int(variant[6:]) >= 1:
        return int(variant[6:])
    raise ValueError(f"unknown variant {variant!r}; use float32, pooledN (N >= 1), int8 or binary")


def server_bytes_per_vector(storage: str, dim: int) -> int:
    """Bytes of one ``dim``-d vector in Qdrant's storage format ``storage`` (float32, int8, binary)."""
    if storage == FLOAT32:
        return 4 * dim
    if storage == "int8":
        return -(-dim // 16) * 16 + 4  # EncodedVectorsU8: dim aligned to 16, plus an f32 correction
    if storage == "binary":
        return -(-dim // 128) * 16  # one bit per number, in 128-bit chunks
    raise ValueError(storage)


def _bytes(variant: str, rows: int, dim: int) -> dict[str, Any]:
    mean = server_bytes_per_vector(FLOAT32, dim)
    original = rows * server_bytes_per_vector(FLOAT32, dim)
    if variant in QUANTISED:
        quantised = rows * server_bytes_per_vector(variant, dim)
        return {"multivector_ram": quantised, "page_mean": mean, "ram": quantised + mean,
                "disk": original + quantised + mean, "originals_kept": original}
    return {"multivector_ram": original, "page_mean": mean, "ram": original + mean, "disk": original + mean}


def _unit(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    return x


def _pages(rng: np.random.Generator, n: int, rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pages of ``rows`` unit rows, and their mean-pooled vectors, made in chunks (memory)."""
    pages = np.empty((n, rows, dim), np.float32)
    for s in range(0, n, 256):
        pages[s:s + 256] = _unit(rng, (min(256, n - s), rows, dim))
    means = pages.mean(axis=1)
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    return pages, means


def _ms(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples) * 1000
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "n": len(samples)}


def _collection_config(models, dim: int, quantisation: str | None):
    quant = None
    if quantisation == "int8":
        quant = models.ScalarQuantization(scalar=models.ScalarQuantizationConfig(type=models.ScalarType.INT8,
                                                                                  always_ram=True))
    elif quantisation == "binary":
        quant = models.BinaryQuantization(binary=models.BinaryQuantizationConfig(always_ram=True))
    return {
        "page": models.VectorParams(
            size=dim, distance=models.Distance.COSINE,
            multivector_config=models.MultiVectorConfig(comparator=models.MultiVectorComparator.MAX_SIM),
            hnsw_config=models.HnswConfigDiff(m=0),  # MaxSim only reranks: no graph over the page tokens
            quantization_config=quant,
        ),
        "page_mean": models.VectorParams(size=dim, distance=models.Distance.COSINE),
    }


def _upsert(client, models, name: str, pages: np.ndarray, means: np.ndarray) -> None:
    for s in range(0, len(pages), _UPSERT_BATCH):
        client.upsert(name, points=[
            models.PointStruct(id=i, vector={"page": pages[i].tolist(), "page_mean": means[i].tolist()})
            for i in range(s, min(s + _UPSERT_BATCH, len(pages)))
        ])


def _local_storage_bytes(client, name: str) -> int | None:
    """Bytes of the vector arrays local mode holds for ``name`` (its private storage: a measurement only)."""
    try:
        col = client._client.collections[name]
        multi = sum(a.nbytes for a in col.multivectors["page"])
        dense = len(col.ids) * col.vectors["page_mean"].shape[1] * col.vectors["page_mean"].itemsize
        return int(multi + dense)
    except (AttributeError, KeyError):
        return None


def local_mode_quantisation(dim: int = 16) -> dict[str, Any]:
    """What Qdrant local mode does with ``quantization_config``: build a 3-point collection per kind and read
    back the stored dtype, the bytes and the config it reports."""
    from qdrant_client import QdrantClient, models

    client = QdrantClient(":memory:")
    rng = np.random.default_rng(0)
    pages, means = _pages(rng, 3, 4, dim)
    out: dict[str, Any] = {}
    for kind in (None, *QUANTISED):
        name = kind or FLOAT32
        client.create_collection(name, vectors_config=_collection_config(models, dim, kind))
        _upsert(client, models, name, pages, means)
        info = client.get_collection(name)
        try:
            dtype = str(client._client.collections[name].multivectors["page"][0].dtype)
        except (AttributeError, KeyError):
            dtype = None
        out[name] = {"stored_dtype": dtype, "stored_bytes": _local_storage_bytes(client, name),
                     "accepted_config": info.config.params.vectors["page"].quantization_config is not None}
    client.close()
    ignored = all(out[k]["stored_dtype"] == "float32" and out[k]["stored_bytes"] == out[FLOAT32]["stored_bytes"]
                  for k in QUANTISED)
    return {"ignored": ignored, "collections": out,
            "explanation": "local mode accepts quantization_config and reports it back, but stores every "
                           "multivector as a float32 numpy array and scores it exactly (qdrant_client/local "
                           "reads quantisation nowhere; SearchParams.quantization is listed as ignored): "
                           "quantised bytes and latency exist on a Qdrant server only"}


def _local(variant: str, rows: int, *, n: int, dim: int, queries: list[np.ndarray], prefetch: int, top_k: int,
           rng: np.random.Generator) -> dict[str, Any]:
    from qdrant_client import QdrantClient, models

    pages, means = _pages(rng, n, rows, dim)
    client = QdrantClient(":memory:")
    client.create_collection(variant, vectors_config=_collection_config(models, dim, None))
    t0 = time.perf_counter()
    _upsert(client, models, variant, pages, means)
    build_s = time.perf_counter() - t0
    stored = _local_storage_bytes(client, variant)

    two, single, matches = [], [], True
    for q in queries:
        qm = mean_pool(q)
        t = time.perf_counter()
        res = client.query_points(variant, prefetch=models.Prefetch(query=qm.tolist(), using="page_mean",
                                                                    limit=prefetch),
                                  query=q.tolist(), using="page", limit=top_k)
        two.append(time.perf_counter() - t)
        # The reference: the same prefetch, then brute-force MaxSim over its candidates.
        cands = [p.id for p in client.query_points(variant, query=qm.tolist(), using="page_mean",
                                                   limit=prefetch).points]
        ref = sorted(cands, key=lambda i: -maxsim(q, pages[i]))[:top_k]
        matches &= [p.id for p in res.points] == ref
        t = time.perf_counter()
        client.query_points(variant, query=q.tolist(), using="page", limit=top_k)
        single.append(time.perf_counter() - t)
    client.close()
    del pages, means
    return {"pages": n, "build_s": round(build_s, 2), "build_ms_per_page": round(build_s / n * 1000, 2),
            "stored_bytes_per_page": None if stored is None else round(stored / n),
            "two_stage_ms": _ms(two), "single_stage_ms": _ms(single),
            "two_stage_matches_bruteforce": bool(matches)}


def _exact(rows: int, *, n: int, dim: int, queries: list[np.ndarray], prefetch: int, top_k: int,
           single_queries: int, rng: np.random.Generator) -> dict[str, Any]:
    t0 = time.perf_counter()
    pages, means = _pages(rng, n, rows, dim)
    gen_s = time.perf_counter() - t0
    two = []
    for q in queries:
        t = time.perf_counter()
        dense = means @ mean_pool(q)
        cands = np.argpartition(-dense, min(prefetch, n) - 1)[:prefetch]
        scores = np.matmul(pages[cands], q.T).max(axis=1).sum(axis=1)  # (prefetch,)
        _ = cands[np.argsort(-scores)[:top_k]]
        two.append(time.perf_counter() - t)
    single = []
    flat = pages.reshape(-1, dim)
    chunk = max(1, 4_000_000 // max(rows, 1))  # pages per matmul: bounds the (rows, query) temporaries
    for q in queries[:single_queries]:
        t = time.perf_counter()
        scores = np.concatenate([
            (flat[s * rows:min(s + chunk, n) * rows] @ q.T).reshape(-1, rows, len(q)).max(axis=1).sum(axis=1)
            for s in range(0, n, chunk)
        ])
        _ = np.argpartition(-scores, min(top_k, n) - 1)[:top_k]
        single.append(time.perf_counter() - t)
    del pages, means, flat
    return {"pages": n, "data_gen_s": round(gen_s, 2), "two_stage_ms": _ms(two), "single_stage_ms": _ms(single)}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_late_cost(*, pages: int = 10_000, tokens_per_page: int = COLQWEN2_PAGE_TOKENS, dim: int = 128,
                  query_tokens: int = 20, queries: int = 50, prefetch: int = 100, top_k: int = 10,
                  variants: tuple[str, ...] = DEFAULT_VARIANTS, local_pages: int = 1_000, local_queries: int = 10,
                  single_stage_queries: int = 10, seed: int = 0, blas_threads: int | None = 1) -> dict[str, Any]:
    """Measure the late-interaction storage variants (see the module docstring). ``local_pages`` caps the local-
    mode scale (its figures are extrapolated to ``pages``), ``local_queries`` and ``single_stage_queries`` cap the
    queries timed where each one scans every page; 0 skips that part."""
    from mmrag.adapters import qdrant_local

    qdrant_local.install()  # local mode as mmrag runs it (the module docstring)
    factors = {v: _pool_factor(v) for v in variants}
    rng = np.random.default_rng(seed)
    qs = [_unit(rng, (query_tokens, dim)) for _ in range(queries)]
    n_local = min(pages, local_pages)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # scikit-learn's dependency, normally present
        threadpool_limits = None
    limit = (threadpool_limits(limits=blas_threads, user_api="blas")
             if blas_threads and threadpool_limits else nullcontext())
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "params": {"pages": pages, "tokens_per_page": tokens_per_page, "dim": dim, "query_tokens": query_tokens,
                   "queries": queries, "prefetch": prefetch, "top_k": top_k, "local_pages": n_local,
                   "local_queries": min(local_queries, queries),
                   "single_stage_queries": min(single_stage_queries, queries), "seed": seed},
        "machine": {"cpu": _cpu(), "cpus": os.cpu_count(),
                    "blas_threads": blas_threads if threadpool_limits else None},
        "variants": {},
    }
    with limit:
        result["local_mode_quantisation"] = local_mode_quantisation()
        ignored = result["local_mode_quantisation"]["ignored"]
        for variant, factor in factors.items():
            rows = max(tokens_per_page // factor, 1)
            entry: dict[str, Any] = {"rows_per_page": rows, "pool_factor": factor,
                                     "storage": variant if variant in QUANTISED else FLOAT32,
                                     "bytes_per_page": _bytes(variant, rows, dim)}
            if variant in QUANTISED and ignored:
                reason = ("local mode ignores quantisation (stores and scores float32): latency and build time "
                          "are measurable on a Qdrant server only; bytes are from Qdrant's format")
                entry["local"] = {"skipped": reason}
                entry["exact"] = {"skipped": "Qdrant's quantised SIMD kernels are not emulated in numpy"}
            else:
                if n_local and local_queries:
                    local = _local(variant, rows, n=n_local, dim=dim, queries=qs[:local_queries],
                                   prefetch=prefetch, top_k=top_k, rng=rng)
                    scale = pages / n_local
                    local["extrapolated_to_pages"] = {
                        "pages": pages, "build_s": round(local["build_s"] * scale, 1),
                        "two_stage_ms_p50": round(local["two_stage_ms"]["p50"] * scale, 1),
                        "single_stage_ms_p50": round(local["single_stage_ms"]["p50"] * scale, 1),
                        "stored_gib": None if local["stored_bytes_per_page"] is None
                        else round(local["stored_bytes_per_page"] * pages / 2**30, 2),
                    }
                    entry["local"] = local
                else:
                    entry["local"] = {"skipped": "local_pages or local_queries is 0"}
                entry["exact"] = _exact(rows, n=pages, dim=dim, queries=qs, prefetch=prefetch, top_k=top_k,
                                        single_queries=min(single_stage_queries, queries), rng=rng)
            result["variants"][variant] = entry
    base = result["variants"].get(FLOAT32)
    if base:
        for entry in result["variants"].values():
            entry["ram_vs_float32"] = round(entry["bytes_per_page"]["ram"] / base["bytes_per_page"]["ram"], 4)
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    return result


def print_late_cost(result: dict[str, Any], console) -> None:
    """Print a ``run_late_cost`` result as rich tables on ``console``."""
    from rich.table import Table

    p, m = result["params"], result["machine"]

    def lat(d: dict[str, Any] | None, key: str) -> str:
        if not d or "skipped" in d or key not in d:
            return "-"
        return f"{d[key]['p50']:,.1f} / {d[key]['p99']:,.1f}"

    sizes = Table(title=f"Late interaction: bytes per page on a Qdrant server ({p['tokens_per_page']} x {p['dim']}"
                        f" page, + page_mean)")
    for col in ("variant", "rows/page", "RAM bytes", "vs float32", "disk bytes", "local-mode bytes (measured)"):
        sizes.add_column(col, justify="right")
    for name, v in result["variants"].items():
        b = v["bytes_per_page"]
        local = v.get("local", {})
        sizes.add_row(name, str(v["rows_per_page"]), f"{b['ram']:,}", f"{v.get('ram_vs_float32', 1):.3f}",
                      f"{b['disk']:,}", "-" if "skipped" in local else f"{local.get('stored_bytes_per_page') or 0:,}")
    console.print(sizes)

    lat_t = Table(title=f"Query latency ms p50 / p99 (query {p['query_tokens']} rows, prefetch {p['prefetch']}, "
                        f"top {p['top_k']})")
    for col in ("variant", f"local build s ({p['local_pages']} pages)", f"local 2-stage ({p['local_pages']})",
                f"local 1-stage ({p['local_pages']})", f"exact 2-stage ({p['pages']})",
                f"exact 1-stage ({p['pages']})"):
        lat_t.add_column(col, justify="right")
    for name, v in result["variants"].items():
        local, exact = v.get("local", {}), v.get("exact", {})
        lat_t.add_row(name, "-" if "skipped" in local else f"{local['build_s']:,.1f}",
                      lat(local, "two_stage_ms"), lat(local, "single_stage_ms"),
                      lat(exact, "two_stage_ms"), lat(exact, "single_stage_ms"))
    console.print(lat_t)
    for name, v in result["variants"].items():
        ext = v.get("local", {}).get("extrapolated_to_pages")
        if ext:
            console.print(f"  {name}: local mode at {ext['pages']:,} pages (linear): build ~{ext['build_s']:,} s, "
                          f"{ext['stored_gib']} GiB, 2-stage ~{ext['two_stage_ms_p50']:,} ms, "
                          f"1-stage ~{ext['single_stage_ms_p50']:,} ms per query; "
                          f"2-stage = brute force: {v['local']['two_stage_matches_bruteforce']}")
    q = result["local_mode_quantisation"]
    console.print(f"Quantisation in local mode: {'ignored' if q['ignored'] else 'applied'} ({q['explanation']})")
    console.print(f"{m['cpu']}, {m['cpus']} CPUs, BLAS threads {m['blas_threads']}; total {result['total_s']} s")


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    from rich.console import Console

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=10_000)
    ap.add_argument("--tokens-per-page", type=int, default=COLQWEN2_PAGE_TOKENS)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--prefetch", type=int, default=100)
    ap.add_argument("--local-pages", type=int, default=1_000)
    ap.add_argument("--local-queries", type=int, default=10)
    ap.add_argument("--single-stage-queries", type=int, default=10)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    result = run_late_cost(pages=args.pages, tokens_per_page=args.tokens_per_page, queries=args.queries,
                           prefetch=args.prefetch, local_pages=args.local_pages, local_queries=args.local_queries,
                           single_stage_queries=args.single_stage_queries,
                           variants=tuple(v for v in args.variants.split(",") if v))
    print_late_cost(result, Console())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
