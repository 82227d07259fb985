"""The Qdrant page index in embedded local mode: explicit schema, clear errors, document replacement."""

import subprocess
import sys
import textwrap

import pytest
from qdrant_client import models

from mmrag.core.keys import ImageKey
from mmrag.core.pages import TextSource
from mmrag.core.payload import PagePayload
from mmrag.adapters.qdrant import (IndexConfigError, IndexLockedError, LoopBridge, PageIndex, is_local, make_point,
                                   open_async_qdrant, open_qdrant)


def _index(path, text_dim=4, image_dim=3) -> PageIndex:
    index = PageIndex(open_qdrant("", path), "pages", text_dim=text_dim, image_dim=image_dim)
    index.ensure_collection()
    return index


KEY = ImageKey.parse(f"img1-{'c' * 64}-{'ab' * 8}-px1-2")


def _point(doc, page, sha="s1"):
    payload = PagePayload(doc_id=doc, doc=f"{doc}.pdf", path=f"/{doc}.pdf", page=page, num_pages=3, file_sha256=sha,
                          content_hash=KEY.content_hash, image_key=KEY, image_tokens=4, width=1, height=1, text="",
                          text_source=TextSource.NONE, fingerprint="f")
    return make_point({"text": [1.0, 0, 0, 0], "image": [0, 1.0, 0]}, payload)


def test_collection_is_created_with_named_vectors_of_the_configured_sizes(tmp_path):
    index = _index(tmp_path / "q")
    params = index.client.get_collection("pages").config.params.vectors
    assert {name: p.size for name, p in params.items()} == {"text": 4, "image": 3}
    assert all(p.distance == models.Distance.COSINE for p in params.values())


def test_collection_has_the_lexical_sparse_vector_with_idf_and_late_vectors_when_asked(tmp_path):
    index = _index(tmp_path / "q")
    sparse = index.client.get_collection("pages").config.params.sparse_vectors
    assert set(sparse) == {"lexical"} and sparse["lexical"].modifier == models.Modifier.IDF
    late = PageIndex(open_qdrant("", tmp_path / "late"), "pages", text_dim=4, image_dim=3, late_dim=8)
    late.ensure_collection()
    params = late.client.get_collection("pages").config.params.vectors
    assert params["page"].multivector_config.comparator == models.MultiVectorComparator.MAX_SIM
    assert params["page"].hnsw_config.m == 0 and params["page_mean"].size == 8 and params["page_mean"].multivector_config is None
    page = _point("d1", 1).payload
    point = make_point({"text": [1.0, 0, 0, 0], "lexical": ([7, 3], [0.5, 1.0]), "page": [[1.0] + [0.0] * 7] * 3,
                        "page_mean": [1.0] + [0.0] * 7}, PagePayload.from_qdrant(page))
    late.client.upsert("pages", points=[point], wait=True)
    (stored,) = late.client.retrieve("pages", [point.id], with_vectors=True)
    lexical = stored.vector["lexical"]
    assert dict(zip(lexical.indices, lexical.values)) == {7: 0.5, 3: 1.0} and len(stored.vector["page"]) == 3


def test_reopening_a_local_collection_writes_nothing_to_its_folder(tmp_path):
    """Every ingest job, deletion and retry opens the index (PageIndex.ensure_collection): in local mode that must
    not rewrite the folder's meta.json, which a copy of the folder beside the server reads (tests/
    test_deletion_leases.py's gc). Local mode keeps no payload indexes, so none is asked for there."""
    from qdrant_client import QdrantClient

    index = _index(tmp_path / "q")
    meta = tmp_path / "q" / "meta.json"
    before = meta.stat()
    for _ in range(3):
        PageIndex(index.client, "pages", text_dim=4, image_dim=3).ensure_collection()
    after = meta.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == [".lock", "collection", "meta.json"]
    # What tells local mode from a server: the folder or :memory:, through the bridge the server's jobs write by.
    assert is_local(index.client) and is_local(QdrantClient(":memory:"))
    bridge = LoopBridge(open_async_qdrant("", tmp_path / "a"), loop=None)  # type: ignore[arg-type]
    assert is_local(bridge)
    assert not is_local(QdrantClient(url="http://127.0.0.1:6333", check_compatibility=False))  # asks nothing yet


def test_a_collection_built_before_the_lexical_channel_names_the_fix(tmp_path):
    client = open_qdrant("", tmp_path / "q")
    client.create_collection("pages", vectors_config={
        "text": models.VectorParams(size=4, distance=models.Distance.COSINE),
        "image": models.VectorParams(size=3, distance=models.Distance.COSINE)})
    with pytest.raises(IndexConfigError, match="before the lexical channel.*mmrag index reset"):
        PageIndex(client, "pages", text_dim=4, image_dim=3).ensure_collection()


def test_reopening_with_other_vector_sizes_names_the_fix(tmp_path):
    index = _index(tmp_path / "q")
    index.client.close()
    with pytest.raises(IndexConfigError, match="mmrag index reset"):
        _index(tmp_path / "q", text_dim=8)


def test_replacing_a_document_drops_pages_it_no_longer_has(tmp_path):
    index = _index(tmp_path / "q")
    index.replace_document("d1", [_point("d1", p) for p in (1, 2, 3)])
    index.replace_document("d2", [_point("d2", 1)])
    index.replace_document("d1", [_point("d1", p, sha="s2") for p in (1, 2)])
    pages = index.doc_pages("d1")
    assert [(p.page, p.file_sha256) for p in pages] == [(1, "s2"), (2, "s2")]
    assert index.count() == 3  # d2 untouched


def test_a_folder_held_by_another_process_gives_a_message_that_says_what_to_do(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from qdrant_client import QdrantClient
            c = QdrantClient(path={str(tmp_path / 'q')!r})
            print("holding", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == b"holding"
        with pytest.raises(IndexLockedError, match="MMRAG_QDRANT_URL") as info:
            open_qdrant("", tmp_path / "q")
        assert "Stop that process" in str(info.value)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    open_qdrant("", tmp_path / "q").close()  # released: opens fine again
