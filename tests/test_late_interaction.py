"""The late-interaction page retriever (mmrag/adapters/late.py) on the tiny random-weight ColQwen2
(mmrag/devkit/tiny_colqwen.py), Qdrant's two-stage multivector query in local mode, and the cost benchmark's quick mode."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmrag.adapters.checkpoint import MARKER_FILE, read_marker
from mmrag.adapters.late import LateInteractionRetriever, maxsim, mean_pool, pool_tokens
from mmrag.devkit.tiny_colqwen import MODEL_NAME, build_tiny_colqwen2, ensure_tiny_colqwen2

REPO = Path(__file__).resolve().parents[1]
DIM = 128


def _page(seed: int, size: tuple[int, int] = (112, 112)) -> Image.Image:
    """A distinct small page: 112x112 -> 4x4 = 16 merged visual tokens."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_tiny_colqwen2(tmp_path_factory.mktemp("late") / "tiny-colqwen2")


@pytest.fixture(scope="module")
def retriever(checkpoint) -> LateInteractionRetriever:
    return LateInteractionRetriever(checkpoint, batch_size=4)


def _unit_rows(arrays: list[np.ndarray]) -> bool:
    return all(np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5) for a in arrays)


def test_the_checkpoint_is_a_colqwen2_that_loads_offline_and_says_it_is_random(checkpoint):
    import torch
    from colpali_engine.models import ColQwen2, ColQwen2Processor

    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["ColQwen2"] and config["model_type"] == "qwen2_vl"
    model = ColQwen2.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True)
    processor = ColQwen2Processor.from_pretrained(checkpoint, local_files_only=True)
    assert model.dim == DIM and model.custom_text_proj.out_features == DIM
    assert processor.image_processor.size["longest_edge"] == 768 * 28 * 28  # the released ColQwen2's cap
    marker = read_marker(checkpoint)
    assert marker["random_weights"] is True and marker["name"] == MODEL_NAME
    assert (checkpoint / MARKER_FILE).stat().st_mode & 0o044 == 0o044
    # Built once, reused; a folder holding something else is refused, not overwritten.
    before = (checkpoint / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_colqwen2(checkpoint) == checkpoint
    assert (checkpoint / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(FileExistsError):
        ensure_tiny_colqwen2(checkpoint, seed=1)


def test_pages_and_queries_are_unit_multivectors_of_the_right_shape(retriever):
    assert retriever.dim == DIM and retriever.random_weights and retriever.dtype == "float32"
    assert retriever.name == "tiny-colqwen2 (random weights)"
    pages = retriever.embed_pages([_page(0), _page(1, (112, 168))])
    assert [p.dtype for p in pages] == [np.float32, np.float32]
    assert [p.shape[1] for p in pages] == [DIM, DIM]
    # Every real token of the page prompt: 16 and 24 visual tokens (28x28 pixels each) plus the same text.
    assert pages[1].shape[0] - pages[0].shape[0] == 24 - 16
    assert pages[0].shape[0] > 16
    queries = retriever.embed_queries(["revenue by quarter", "x"])
    assert [q.shape[1] for q in queries] == [DIM, DIM]
    assert queries[0].shape[0] > queries[1].shape[0] >= 11  # a query's tokens + 10 augmentation tokens
    assert _unit_rows(pages) and _unit_rows(queries)


def test_embeddings_are_deterministic(retriever, checkpoint):
    page = _page(3)
    a = retriever.embed_pages([page])[0]
    b = retriever.embed_pages([page])[0]
    assert np.array_equal(a, b)
    again = LateInteractionRetriever(checkpoint).embed_pages([page])[0]
    assert np.array_equal(a, again)
    twice = retriever.embed_pages([page, page])
    assert np.array_equal(twice[0], twice[1])


def test_padding_rows_are_dropped(retriever):
    short, long = "pie chart", "the table of quarterly revenue by region in the second annual report appendix"
    batch = retriever.embed_queries([short, long])
    alone = [retriever.embed_queries([short])[0], retriever.embed_queries([long])[0]]
    for got, want in zip(batch, alone):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)
    # Pages of different sizes in one batch: padded pixels and left-padded tokens both dropped.
    small, big = _page(4), _page(5, (168, 224))
    batch = retriever.embed_pages([small, big])
    for got, want in zip(batch, [retriever.embed_pages([small])[0], retriever.embed_pages([big])[0]]):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_maxsim_is_colpali_engines_score(retriever):
    import torch
    from colpali_engine.models import ColQwen2Processor

    pages = retriever.embed_pages([_page(i) for i in range(3)])
    queries = retriever.embed_queries(["a", "bar chart of sales"])
    ours = np.array([[maxsim(q, p) for p in pages] for q in queries])
    theirs = ColQwen2Processor.score_multi_vector([torch.from_numpy(q) for q in queries],
                                                  [torch.from_numpy(p) for p in pages], device="cpu")
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-5, atol=1e-4)


def test_pool_tokens_and_mean_pool(retriever):
    page = retriever.embed_pages([_page(6, (224, 224))])[0]  # 64 visual tokens + the prompt's
    n = page.shape[0]
    assert pool_tokens(page, 1) is page
    for factor in (2, 3, 4):
        pooled = pool_tokens(page, factor)
        assert pooled.dtype == np.float32 and pooled.shape[1] == DIM
        assert 1 <= pooled.shape[0] <= n // factor
        assert pooled.shape[0] >= 0.8 * (n // factor)  # about n / factor clusters
        assert _unit_rows([pooled])
    assert np.array_equal(pool_tokens(page, 3), pool_tokens(page, 3))  # deterministic
    assert pool_tokens(page[:1], 3).shape == (1, DIM)
    with pytest.raises(ValueError):
        pool_tokens(page, 0)
    m = mean_pool(page)
    assert m.shape == (DIM,) and m.dtype == np.float32
    assert abs(float(np.linalg.norm(m)) - 1.0) < 1e-5
    want = page.mean(axis=0)
    np.testing.assert_allclose(m, want / np.linalg.norm(want), atol=1e-6)


def test_qdrant_two_stage_query_ranks_as_brute_force_maxsim(retriever):
    from qdrant_client import QdrantClient, models

    pages = retriever.embed_pages([_page(100 + i, (112, 112 + 56 * (i % 3))) for i in range(12)])
    queries = retriever.embed_queries(["quarterly revenue", "a diagram of the pipeline", "table 3"])
    client = QdrantClient(":memory:")
    client.create_collection("pages", vectors_config={
        "page": models.VectorParams(
            size=retriever.dim, distance=models.Distance.COSINE,
            multivector_config=models.MultiVectorConfig(comparator=models.MultiVectorComparator.MAX_SIM),
            hnsw_config=models.HnswConfigDiff(m=0)),
        "page_mean": models.VectorParams(size=retriever.dim, distance=models.Distance.COSINE),
    })
    client.upsert("pages", points=[
        models.PointStruct(id=i, vector={"page": p.tolist(), "page_mean": mean_pool(p).tolist()})
        for i, p in enumerate(pages)
    ])
    prefetch, top_k = 6, 4
    for q in queries:
        qm = mean_pool(q).tolist()
        got = client.query_points("pages", prefetch=models.Prefetch(query=qm, using="page_mean", limit=prefetch),
                                  query=q.tolist(), using="page", limit=top_k).points
        candidates = [p.id for p in client.query_points("pages", query=qm, using="page_mean",
                                                        limit=prefetch).points]
        assert len(candidates) == prefetch
        scores = {i: maxsim(q, pages[i]) for i in candidates}
        want = sorted(candidates, key=lambda i: -scores[i])[:top_k]
        assert [p.id for p in got] == want
        for p in got:
            assert abs(p.score - scores[p.id]) < 1e-4
        # Only prefetched pages can come back, even where a page outside them scores higher.
        assert {p.id for p in got} <= set(candidates)
    client.close()


def test_a_missing_or_wrong_checkpoint_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="MMRAG_PAGE_RETRIEVER"):
        LateInteractionRetriever(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="MMRAG_PAGE_RETRIEVER.*no config.json"):
        LateInteractionRetriever(tmp_path)
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"],
                                                 "model_type": "qwen2_vl"}))
    with pytest.raises(ValueError, match="MMRAG_PAGE_RETRIEVER.*not a supported late-interaction"):
        LateInteractionRetriever(vlm)
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="LoRA adapter"):
        LateInteractionRetriever(adapter)


def test_max_pixels_sets_the_pixel_budget(checkpoint):
    small = LateInteractionRetriever(checkpoint, max_pixels=56 * 56)
    full = LateInteractionRetriever(checkpoint)
    page = _page(7, (224, 224))
    # 224x224 = 64 visual tokens; capped at 56x56 pixels = 4 tokens.
    assert full.embed_pages([page])[0].shape[0] - small.embed_pages([page])[0].shape[0] == 64 - 4


def test_importing_the_adapter_is_cheap():
    probe = ("import sys, mmrag.adapters.late; "
             "print(sorted(m for m in ('torch', 'transformers', 'colpali_engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_late_cost_quick_mode():
    from mmrag.bench.late_cost import print_late_cost, run_late_cost

    result = run_late_cost(pages=40, tokens_per_page=30, query_tokens=5, queries=3, prefetch=8, top_k=3,
                           variants=("float32", "pooled3", "int8", "binary"), local_pages=20, local_queries=2,
                           single_stage_queries=2)
    v = result["variants"]
    assert set(v) == {"float32", "pooled3", "int8", "binary"}
    assert v["pooled3"]["rows_per_page"] == 10
    for name in ("float32", "pooled3"):
        assert v[name]["local"]["pages"] == 20
        assert v[name]["local"]["two_stage_matches_bruteforce"] is True
        assert v[name]["local"]["stored_bytes_per_page"] == v[name]["bytes_per_page"]["ram"]
        for key in ("two_stage_ms", "single_stage_ms"):
            assert v[name]["local"][key]["p50"] > 0 and v[name]["exact"][key]["p50"] > 0
        assert v[name]["exact"]["pages"] == 40
    assert v["pooled3"]["bytes_per_page"]["ram"] < v["float32"]["bytes_per_page"]["ram"]
    assert v["binary"]["bytes_per_page"]["ram"] < v["int8"]["bytes_per_page"]["ram"] \
        < v["float32"]["bytes_per_page"]["ram"]
    assert v["int8"]["bytes_per_page"]["disk"] > v["float32"]["bytes_per_page"]["disk"]  # originals are kept
    quant = result["local_mode_quantisation"]
    assert isinstance(quant["ignored"], bool)
    if quant["ignored"]:
        assert "skipped" in v["int8"]["local"] and "skipped" in v["binary"]["local"]
    from rich.console import Console

    console = Console(record=True, width=200)
    print_late_cost(result, console)
    assert "pooled3" in console.export_text()
